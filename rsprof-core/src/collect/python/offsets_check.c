/* Prints name=offset for each entry of profiler-user/src/python/offsets.rs, compiled against one
 * CPython's headers (its internal ones included): the table's test compares them. */
#define Py_BUILD_CORE 1
#include <Python.h>
#include <stddef.h>
#include <stdio.h>
#if PY_MINOR_VERSION == 8
#include "internal/pycore_pystate.h"
#else
#include "internal/pycore_runtime.h"
#endif
#if PY_MINOR_VERSION >= 11
#include "internal/pycore_frame.h"
#include "internal/pycore_code.h"
#endif
#include "frameobject.h"
#define P(n, e) printf("%s=%zu\n", n, (size_t)(e))
int main(void) {
#if PY_MINOR_VERSION <= 11
  P("runtime_tss_key", offsetof(_PyRuntimeState, gilstate.autoTSSkey._key));
#else
  P("runtime_tss_key", offsetof(_PyRuntimeState, autoTSSkey._key));
#endif
#if PY_MINOR_VERSION <= 10
  P("tstate_frame", offsetof(PyThreadState, frame));
  P("frame_back", offsetof(PyFrameObject, f_back));
  P("frame_code", offsetof(PyFrameObject, f_code));
  P("frame_ip", offsetof(PyFrameObject, f_lasti));
#elif PY_MINOR_VERSION <= 12
  P("tstate_frame", offsetof(PyThreadState, cframe));
  P("cframe_frame", offsetof(_PyCFrame, current_frame));
  P("frame_back", offsetof(_PyInterpreterFrame, previous));
  P("frame_code", offsetof(_PyInterpreterFrame, f_code));
  P("frame_ip", offsetof(_PyInterpreterFrame, prev_instr));
  P("frame_owner", offsetof(_PyInterpreterFrame, owner));
#else
  P("tstate_frame", offsetof(PyThreadState, current_frame));
  P("frame_back", offsetof(_PyInterpreterFrame, previous));
  P("frame_code", offsetof(_PyInterpreterFrame, f_executable));
  P("frame_ip", offsetof(_PyInterpreterFrame, instr_ptr));
  P("frame_owner", offsetof(_PyInterpreterFrame, owner));
#endif
#if PY_MINOR_VERSION >= 11
  P("tstate_datastack", offsetof(PyThreadState, datastack_chunk));
  P("stack_chunk_data", offsetof(_PyStackChunk, data));
  /* The walker reads the chunk pointer and the top as one pair. */
  _Static_assert(offsetof(PyThreadState, datastack_top) ==
                     offsetof(PyThreadState, datastack_chunk) + sizeof(void *),
                 "datastack_top follows datastack_chunk");
#endif
#if PY_MINOR_VERSION == 11
  P("frame_is_entry", offsetof(_PyInterpreterFrame, is_entry));
#endif
  P("code_firstlineno", offsetof(PyCodeObject, co_firstlineno));
  P("code_filename", offsetof(PyCodeObject, co_filename));
  P("code_name", offsetof(PyCodeObject, co_name));
#if PY_MINOR_VERSION >= 11
  P("code_qualname", offsetof(PyCodeObject, co_qualname));
  P("code_linetable", offsetof(PyCodeObject, co_linetable));
  P("code_adaptive", offsetof(PyCodeObject, co_code_adaptive));
  P("code_firsttraceable", offsetof(PyCodeObject, _co_firsttraceable));
#elif PY_MINOR_VERSION == 10
  P("code_linetable", offsetof(PyCodeObject, co_linetable));
#else
  P("code_linetable", offsetof(PyCodeObject, co_lnotab));
#endif
  P("object_type", offsetof(PyObject, ob_type));
  P("var_size", offsetof(PyVarObject, ob_size));
  P("str_length", offsetof(PyASCIIObject, length));
  P("str_state", offsetof(PyASCIIObject, state));
  P("str_ascii_data", sizeof(PyASCIIObject));
  P("str_compact_data", sizeof(PyCompactUnicodeObject));
  P("bytes_data", offsetof(PyBytesObject, ob_sval));
  return 0;
}
