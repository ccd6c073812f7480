//! The worker's global allocator: the system allocator, with large buffers (a rank's weights)
//! aligned to 2 MiB and marked for transparent huge pages (`madvise(MADV_HUGEPAGE)`) before
//! their first touch, so a fresh process faults its weights in 2 MiB at a time instead of
//! 4 KiB (512x fewer page faults; the kernel zeroes the same bytes either way).

use std::alloc::{GlobalAlloc, Layout, System};

/// Allocations at least this large are huge-page aligned and advised.
const HUGE: usize = 4 << 20;
const HUGE_PAGE: usize = 2 << 20;

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

fn advise(ptr: *mut u8, size: usize) {
    #[cfg(target_os = "linux")]
    if !ptr.is_null() && advises_on_this_thread() {
        // SAFETY: the range lies inside the allocation just made; MADV_HUGEPAGE changes no
        // contents, and a kernel without THP answers EINVAL, which changes nothing either.
        unsafe {
            libc::madvise(ptr.cast(), size, libc::MADV_HUGEPAGE);
        }
    }
}

fn huge(layout: Layout) -> Option<Layout> {
    (layout.size() >= HUGE).then(|| Layout::from_size_align(layout.size(), layout.align().max(HUGE_PAGE)).ok()).flatten()
}

// SAFETY: every call goes to `System` with a layout at least as aligned as asked; `dealloc`
// and `realloc` rebuild the same widened layout from the caller's, so `System` always sees the
// layout it allocated with.
unsafe impl GlobalAlloc for HugePageAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match huge(layout) {
            Some(wide) => {
                // SAFETY: `wide` has a non-zero size (at least HUGE).
                let p = unsafe { System.alloc(wide) };
                advise(p, wide.size());
                p
            }
            // SAFETY: forwarded as is.
            None => unsafe { System.alloc(layout) },
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match huge(layout) {
            Some(wide) => {
                // SAFETY: as in `alloc`.
                let p = unsafe { System.alloc_zeroed(wide) };
                advise(p, wide.size());
                p
            }
            // SAFETY: forwarded as is.
            None => unsafe { System.alloc_zeroed(layout) },
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` with the same widening of `layout`.
        unsafe { System.dealloc(ptr, huge(layout).unwrap_or(layout)) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old = huge(layout).unwrap_or(layout);
        let new = Layout::from_size_align(new_size, layout.align()).ok().and_then(huge);
        match new {
            // Staying small, or already wide and staying wide with the same alignment: System's
            // realloc keeps the alignment it was given.
            None if old.align() == layout.align() => unsafe { System.realloc(ptr, layout, new_size) },
            Some(wide) if old.align() == wide.align() => {
                // SAFETY: `ptr` was allocated with `old`; `wide` keeps its alignment.
                let p = unsafe { System.realloc(ptr, old, new_size) };
                advise(p, new_size);
                p
            }
            // Crossing the threshold changes the alignment: allocate, copy, free.
            _ => {
                let target = new.unwrap_or_else(|| Layout::from_size_align(new_size, layout.align()).unwrap_or(layout));
                // SAFETY: a fresh allocation of `target`, then the old one freed with its own layout.
                unsafe {
                    let p = System.alloc(target);
                    if !p.is_null() {
                        std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                        if new.is_some() {
                            advise(p, target.size());
                        }
                        System.dealloc(ptr, old);
                    }
                    p
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
