//! Names kernel addresses for userspace with the kernel's own kallsyms lookup (`%pS`), so a
//! recording that meets a few kernel frames does not read and parse all of /proc/kallsyms
//! (about 120 k lines, ~50 ms of CPU in the kernel's formatting alone).
//!
//! Never attached: userspace runs it with BPF_PROG_TEST_RUN after filling `KSYM_BATCH`.

use aya_ebpf::{
    helpers::generated::bpf_snprintf,
    macros::{map, raw_tracepoint},
    maps::Array,
    programs::RawTracePointContext,
};
use profiler_common::ksym::{BATCH, KsymBatch, NAME_BYTES};

#[map]
static KSYM_BATCH: Array<KsymBatch> = Array::with_max_entries(1, 0);

/// In .rodata, which aya freezes: bpf_snprintf takes its format only from read-only memory.
static FORMAT: [u8; 4] = *b"%pS\0";

#[raw_tracepoint(tracepoint = "rsprof_name_kernel_addrs")]
pub fn name_kernel_addrs(_ctx: RawTracePointContext) -> i32 {
    let Some(batch) = KSYM_BATCH.get_ptr_mut(0) else { return 1 };
    // SAFETY: the map value outlives the call; every index is below BATCH.
    unsafe {
        for i in 0..BATCH {
            let mut addr = (*batch).addrs[i];
            if addr == 0 {
                break;
            }
            let out = (*batch).names[i].as_mut_ptr();
            if bpf_snprintf(
                out as *mut _,
                NAME_BYTES as u32,
                FORMAT.as_ptr() as *const _,
                &mut addr as *mut u64,
                8,
            ) < 0
            {
                *out = 0;
            }
        }
    }
    0
}
