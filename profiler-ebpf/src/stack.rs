//! Stack walking shared by the CPU sampler and the off-CPU tracker: the kernel stack, then the
//! user stack right after it in the same buffer (`bpf_get_stack`, frame pointers). The
//! in-kernel unwinder will replace the user half here.

use aya_ebpf::{EbpfContext, bindings::BPF_F_USER_STACK, helpers::generated::bpf_get_stack};
use profiler_common::{MAX_STACK_DEPTH, SAMPLE_KERNEL_STACK_ERROR, SAMPLE_USER_STACK_ERROR};

/// What [`walk`] found.
pub struct Walked {
    pub kernel_frames: u16,
    pub user_frames: u16,
    /// `SAMPLE_KERNEL_STACK_ERROR` / `SAMPLE_USER_STACK_ERROR` for a walk that failed.
    pub errors: u32,
}

/// Writes the kernel stack (skipping its innermost `skip` frames) to `frames`, then the user
/// stack after it. The kernel takes the user registers from task_pt_regs when the event hit
/// kernel mode, so syscall-time stacks still get the thread's user stack.
///
/// # Safety
/// `frames` must have room for `2 * MAX_STACK_DEPTH` entries.
#[inline(always)]
pub unsafe fn walk<C: EbpfContext>(ctx: &C, frames: *mut u64, skip: u64) -> Walked {
    const STACK_BYTES: u32 = (MAX_STACK_DEPTH * 8) as u32;
    let mut errors = 0;
    let kret = unsafe { bpf_get_stack(ctx.as_ptr(), frames.cast(), STACK_BYTES, skip) };
    let mut kframes: u64 = 0;
    if kret < 0 {
        errors |= SAMPLE_KERNEL_STACK_ERROR;
    } else {
        kframes = (kret as u64) / 8;
    }
    // Bound for the verifier: the user stack goes right after the kernel frames.
    if kframes > MAX_STACK_DEPTH as u64 {
        kframes = MAX_STACK_DEPTH as u64;
    }
    let uret = unsafe {
        bpf_get_stack(
            ctx.as_ptr(),
            frames.add(kframes as usize).cast(),
            STACK_BYTES,
            BPF_F_USER_STACK as u64,
        )
    };
    let mut uframes: u64 = 0;
    if uret < 0 {
        errors |= SAMPLE_USER_STACK_ERROR;
    } else {
        uframes = (uret as u64) / 8;
    }
    if uframes > MAX_STACK_DEPTH as u64 {
        uframes = MAX_STACK_DEPTH as u64;
    }
    Walked { kernel_frames: kframes as u16, user_frames: uframes as u16, errors }
}
