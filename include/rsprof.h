/*
 * rsprof.h — instrument a C/C++ program for rsprof-bpf (markers, intervals, counters and
 * thread labels), as USDT probes of the `rsprof` provider. See docs/usdt-abi.md.
 *
 * Needs <sys/sdt.h> (Debian: systemtap-sdt-dev). Every probe has a semaphore: while no
 * profiler listens, a probe costs one load and a not-taken branch, and its arguments are not
 * evaluated. rsprof-bpf finds the probes in every profiled process's executable and libraries
 * and the kernel raises the semaphores for it.
 *
 *   RSPROF_MARKER("cache", "miss on key 42");   instant marker: name, text
 *   RSPROF_BEGIN("request", id); ... RSPROF_END(id);   interval, paired by id
 *   RSPROF_COUNTER("queue-depth", n);           counter value
 *   RSPROF_LABEL_PUSH("parse"); ... RSPROF_LABEL_POP();   label the thread's samples
 *
 * Strings are copied up to 127 bytes at the probe. Labels are identified by the string's
 * address, so pass string literals or other strings that live and stay unchanged as long as
 * the program runs.
 */
#ifndef RSPROF_H
#define RSPROF_H

#define _SDT_HAS_SEMAPHORES 1
#include <sys/sdt.h>
#include <stdint.h>

/* One semaphore per probe and module (weak + hidden: every translation unit that includes
 * this header shares it within its executable or shared library). */
#define RSPROF_SEMAPHORE_(probe)                                                          \
    __extension__ unsigned short rsprof_##probe##_semaphore                               \
        __attribute__((weak, visibility("hidden"), section(".probes"), used))

RSPROF_SEMAPHORE_(marker);
RSPROF_SEMAPHORE_(begin);
RSPROF_SEMAPHORE_(end);
RSPROF_SEMAPHORE_(counter);
RSPROF_SEMAPHORE_(label_push);
RSPROF_SEMAPHORE_(label_pop);

/* Nonzero while a profiler listens to `probe`. */
#define RSPROF_ENABLED(probe)                                                             \
    __builtin_expect(*(volatile unsigned short *)&rsprof_##probe##_semaphore != 0, 0)

#define RSPROF_MARKER(name, text)                                                         \
    do {                                                                                  \
        if (RSPROF_ENABLED(marker))                                                       \
            STAP_PROBE2(rsprof, marker, (const char *)(name), (const char *)(text));      \
    } while (0)

#define RSPROF_BEGIN(name, id)                                                            \
    do {                                                                                  \
        if (RSPROF_ENABLED(begin))                                                        \
            STAP_PROBE2(rsprof, begin, (const char *)(name), (uint64_t)(id));             \
    } while (0)

#define RSPROF_END(id)                                                                    \
    do {                                                                                  \
        if (RSPROF_ENABLED(end))                                                          \
            STAP_PROBE1(rsprof, end, (uint64_t)(id));                                     \
    } while (0)

#define RSPROF_COUNTER(name, value)                                                       \
    do {                                                                                  \
        if (RSPROF_ENABLED(counter))                                                      \
            STAP_PROBE2(rsprof, counter, (const char *)(name), (int64_t)(value));         \
    } while (0)

/* Push and pop are unconditional on the semaphore of their own kind only: a profiler that
 * starts between a push and its pop sees the pop without the push; it counts and ignores it. */
#define RSPROF_LABEL_PUSH(label)                                                          \
    do {                                                                                  \
        if (RSPROF_ENABLED(label_push))                                                   \
            STAP_PROBE1(rsprof, label_push, (const char *)(label));                       \
    } while (0)

#define RSPROF_LABEL_POP()                                                                \
    do {                                                                                  \
        if (RSPROF_ENABLED(label_pop))                                                    \
            STAP_PROBE(rsprof, label_pop);                                                \
    } while (0)

#endif /* RSPROF_H */
