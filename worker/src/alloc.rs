//! The worker's global allocator: the system allocator, with large buffers (a rank's weights)
//! mapped straight from the kernel on Linux, 2 MiB aligned and marked for transparent huge
//! pages (`madvise(MADV_HUGEPAGE)`) before their first touch, so a fresh process faults its
//! weights in 2 MiB at a time instead of 4 KiB (512x fewer page faults; the kernel zeroes the
//! same bytes either way). A fresh mapping is zero already, so a zeroed large block
//! (`vec![0u8; n]`) costs no pass over its bytes: the loaders size fresh buffers that way
//! (`orchestrator_kernels::resize_for_overwrite`), and each byte of a fresh load is written
//! once, by the pipeline, instead of first by a fill of zeros.
//!
//! Below that size the system allocator (glibc's malloc on Linux) serves every block from its
//! heaps, and keeps up to [`KEPT_FREE`] free at the top of each instead of handing it back
//! ([`tune_system_allocator`]): glibc's defaults map some blocks between 128 KiB and 32 MiB
//! fresh each time and return heap tops above 128 KiB, so the transient buffers of every probe,
//! round trip, reference and stage were faulted in and zero-filled again by the kernel on each
//! use (page faults of the 4 workers during an update under probes: 35-58 thousand with the
//! defaults, 17-38 thousand tuned here, 8-28 thousand with the same settings from the
//! environment; in a VM whose host reclaims free guest memory each such fault
//! is also a host fault).

use std::alloc::{GlobalAlloc, Layout, System};

/// Allocations at least this large are mapped (Linux) or huge-page aligned (elsewhere).
const HUGE: usize = 4 << 20;
const HUGE_PAGE: usize = 2 << 20;

/// Free bytes each of glibc's heaps keeps at its top rather than returning them.
pub const KEPT_FREE: usize = 32 << 20;

/// Sets glibc's malloc to serve every block below 4 MiB (`HUGE`) from its heaps (the larger ones are
/// this allocator's) and to keep [`KEPT_FREE`] bytes of each heap's free top (module docs).
/// Call it first thing in `main`. False when glibc refused a value (its defaults then stay,
/// which are correct, only slower); elsewhere than glibc it does nothing and says true.
pub fn tune_system_allocator() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only sets parameters; both values fit an int.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, HUGE as libc::c_int) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, KEPT_FREE as libc::c_int) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        true
    }
}

pub struct HugePageAlloc;

std::thread_local! {
    /// Set on threads whose allocations must not be advised (see [`small_pages_on_this_thread`]).
    static SMALL_PAGES: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Large buffers allocated by the calling thread from now on keep 4 KiB pages (they stay 2 MiB
/// aligned). Background work beside serving calls it: a huge-page fault is one uninterruptible
/// stretch of 2 MiB (and, in a VM whose host reclaims free guest memory, a host fault of 2 MiB
/// that the guest scheduler cannot preempt), which stalls the core a serving probe wants;
/// 4 KiB faults leave the scheduler a chance between every page.
pub fn small_pages_on_this_thread() {
    SMALL_PAGES.with(|s| s.set(true));
}

/// Whether large buffers allocated by the calling thread get huge pages.
pub fn advises_on_this_thread() -> bool {
    !SMALL_PAGES.with(|s| s.get())
}

fn is_large(layout: Layout) -> bool {
    layout.size() >= HUGE && layout.align() <= HUGE_PAGE
}

#[cfg(target_os = "linux")]
mod large {
    use super::{HUGE_PAGE, advises_on_this_thread};

    /// Bytes mapped for a block of `size`: whole huge pages (so the end of the block is page
    /// aligned whatever the base page size).
    fn mapped_len(size: usize) -> Option<usize> {
        size.checked_next_multiple_of(HUGE_PAGE)
    }

    /// A fresh, zeroed, 2 MiB-aligned mapping of at least `size` bytes, or null.
    pub fn map(size: usize) -> *mut u8 {
        let Some(len) = mapped_len(size) else { return std::ptr::null_mut() };
        let Some(over) = len.checked_add(HUGE_PAGE) else { return std::ptr::null_mut() };
        // SAFETY: a new private anonymous mapping; nothing else refers to it.
        let base = unsafe {
            libc::mmap(std::ptr::null_mut(), over, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        if base == libc::MAP_FAILED {
            return std::ptr::null_mut();
        }
        let base = base as usize;
        let start = base.next_multiple_of(HUGE_PAGE);
        // SAFETY: the slop before `start` and after `start + len` lies inside the mapping just
        // made, on page boundaries (mappings start on one; `start` and `len` are multiples of
        // 2 MiB); unmapping it leaves exactly [start, start + len).
        unsafe {
            if start > base {
                libc::munmap(base as *mut libc::c_void, start - base);
            }
            let tail = base + over - (start + len);
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
            if advises_on_this_thread() {
                // MADV_HUGEPAGE changes no contents; a kernel without THP answers EINVAL,
                // which changes nothing either.
                libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
            }
        }
        start as *mut u8
    }

    /// Unmaps a block [`map`] made for `size` bytes.
    ///
    /// # Safety
    /// `ptr` came from `map(size)` and is not used afterwards.
    pub unsafe fn unmap(ptr: *mut u8, size: usize) {
        if let Some(len) = mapped_len(size) {
            // SAFETY: the caller's contract: exactly the range `map` kept.
            unsafe { libc::munmap(ptr.cast(), len) };
        }
    }
}

#[cfg(not(target_os = "linux"))]
mod large {
    use super::HUGE_PAGE;
    use std::alloc::{GlobalAlloc, Layout, System};

    fn wide(size: usize) -> Option<Layout> {
        Layout::from_size_align(size, HUGE_PAGE).ok()
    }

    pub fn map(size: usize) -> *mut u8 {
        // SAFETY: `size` is at least HUGE, so not zero.
        wide(size).map_or(std::ptr::null_mut(), |l| unsafe { System.alloc_zeroed(l) })
    }

    /// # Safety
    /// `ptr` came from `map(size)` and is not used afterwards.
    pub unsafe fn unmap(ptr: *mut u8, size: usize) {
        if let Some(l) = wide(size) {
            // SAFETY: allocated by `map` with this layout.
            unsafe { System.dealloc(ptr, l) }
        }
    }
}

// SAFETY: a large block (at least HUGE bytes, alignment at most 2 MiB) comes from `large::map`,
// 2 MiB aligned, and goes back to `large::unmap` with the same size; every other block is
// `System`'s, with the caller's layout. `realloc` moves a block between the two kinds by
// allocating, copying and freeing, so each block is always freed by the kind that made it.
unsafe impl GlobalAlloc for HugePageAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if is_large(layout) {
            large::map(layout.size())
        } else {
            // SAFETY: forwarded as is.
            unsafe { System.alloc(layout) }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if is_large(layout) {
            // A fresh mapping reads as zeros: nothing to fill.
            large::map(layout.size())
        } else {
            // SAFETY: forwarded as is.
            unsafe { System.alloc_zeroed(layout) }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if is_large(layout) {
            // SAFETY: a large layout's block came from `large::map` of the same size.
            unsafe { large::unmap(ptr, layout.size()) }
        } else {
            // SAFETY: forwarded as is.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let Ok(new) = Layout::from_size_align(new_size, layout.align()) else { return std::ptr::null_mut() };
        if !is_large(layout) && !is_large(new) {
            // SAFETY: both small: forwarded as is.
            return unsafe { System.realloc(ptr, layout, new_size) };
        }
        // SAFETY: a fresh block of the new layout, the common prefix copied, then the old block
        // freed by the kind that made it.
        unsafe {
            let p = self.alloc(new);
            if !p.is_null() {
                std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
            p
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// glibc takes both values (it refuses, for one, a mapping threshold above 32 MiB).
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn glibc_takes_the_tuned_parameters() {
        assert!(tune_system_allocator());
    }

    /// Large blocks come back 2 MiB aligned; growing across the threshold and shrinking back
    /// keep the contents; every block is freed with the layout it was made with (a mismatch
    /// would abort the test process in the system allocator).
    #[test]
    fn large_blocks_are_huge_page_aligned_and_keep_their_bytes_across_reallocs() {
        let a = HugePageAlloc;
        unsafe {
            let small = Layout::from_size_align(1 << 20, 8).unwrap();
            let p = a.alloc(small);
            assert!(!p.is_null());
            for i in 0..small.size() {
                *p.add(i) = (i % 251) as u8;
            }
            // Grow past the threshold: moved into an aligned block with the same bytes.
            let big = 9 << 20;
            let q = a.realloc(p, small, big);
            assert_eq!(q as usize % HUGE_PAGE, 0);
            assert!((0..small.size()).all(|i| *q.add(i) == (i % 251) as u8));
            // Grow while large, then shrink below the threshold.
            let bigger = a.realloc(q, Layout::from_size_align(big, 8).unwrap(), 17 << 20);
            assert_eq!(bigger as usize % HUGE_PAGE, 0);
            assert!((0..small.size()).all(|i| *bigger.add(i) == (i % 251) as u8));
            let back = a.realloc(bigger, Layout::from_size_align(17 << 20, 8).unwrap(), 1000);
            assert!((0..1000).all(|i| *back.add(i) == (i % 251) as u8));
            a.dealloc(back, Layout::from_size_align(1000, 8).unwrap());
            let z = a.alloc_zeroed(Layout::from_size_align(HUGE, 64).unwrap());
            assert_eq!(z as usize % HUGE_PAGE, 0);
            assert!((0..HUGE).step_by(4096).all(|i| *z.add(i) == 0));
            a.dealloc(z, Layout::from_size_align(HUGE, 64).unwrap());
        }
    }

    /// A zeroed large block is not filled (a fresh mapping is zero): it must read as zeros
    /// even where a block just freed was written, at every byte, for sizes that are and are not
    /// whole huge pages.
    #[test]
    fn zeroed_large_blocks_read_as_zeros_after_a_written_block_is_freed() {
        let a = HugePageAlloc;
        for size in [HUGE, HUGE + 12_345, 3 * HUGE_PAGE + 1] {
            let layout = Layout::from_size_align(size, 1).unwrap();
            unsafe {
                let p = a.alloc(layout);
                assert!(!p.is_null());
                std::ptr::write_bytes(p, 0xA5, size);
                a.dealloc(p, layout);
                let z = a.alloc_zeroed(layout);
                assert!(!z.is_null());
                assert_eq!(z as usize % HUGE_PAGE, 0);
                assert!(std::slice::from_raw_parts(z, size).iter().all(|&b| b == 0), "{size}");
                a.dealloc(z, layout);
            }
        }
    }
}
