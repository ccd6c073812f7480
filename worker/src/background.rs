//! Serving first: work a rank does beside serving (staging a new version, opening it, its
//! reference, round trip and verification probe) runs on a thread pool of its own whose
//! threads run under `SCHED_IDLE` (and nice +10 where that policy cannot be set), so that the
//! probes of the version that serves, on rayon's global pool at normal priority, never queue
//! behind it: rayon jobs of the two pools never share a queue, and the kernel runs background
//! threads only on cores that serving leaves idle (a nice +10 thread still took about a tenth
//! of a contended core: `bench update` measured probe p50 during an update 0.20-0.23 s under
//! nice +10 and 0.13-0.14 s under SCHED_IDLE, 0.12-0.13 s before it). Their large buffers keep
//! 4 KiB pages ([`crate::alloc::small_pages_on_this_thread`]). The pool has as many threads as
//! the machine has cores (bounded), and is made once per process. [`on_a_pool_thread`] is the
//! other side of it: work that computes on the pool it is called from (a probe) starts on one of
//! that pool's threads.

use std::sync::OnceLock;

/// The niceness of background threads (Linux: per thread).
pub const BACKGROUND_NICE: i32 = 10;

fn pool() -> &'static rayon::ThreadPool {
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(64);
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("background-{i}"))
            .start_handler(|_| {
                lower_this_thread();
                if std::env::var_os("ORCH_STAGE_HUGE").is_none() {
                    crate::alloc::small_pages_on_this_thread();
                }
            })
            .build()
            .unwrap_or_else(|_| rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("a one-thread pool"))
    })
}

/// Lowers the calling thread's scheduling priority (best effort: where it cannot, the work
/// still runs on its own pool).
fn lower_this_thread() {
    #[cfg(target_os = "linux")]
    // SAFETY: gettid and setpriority take no pointers; PRIO_PROCESS with a thread id sets that
    // thread's nice value on Linux.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        let _ = libc::setpriority(libc::PRIO_PROCESS, tid, BACKGROUND_NICE);
        // SCHED_IDLE: the thread runs when a core has nothing else to run (its nice value
        // stays as the fallback where the policy cannot be set).
        let param = libc::sched_param { sched_priority: 0 };
        let _ = libc::sched_setscheduler(tid as libc::pid_t, libc::SCHED_IDLE, &param);
    }
}

/// Runs `f` (and every rayon job it starts) on the background pool.
pub fn run<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    pool().install(f)
}

/// Runs `f` on a thread of the rayon pool the caller is in, the global one from any other
/// thread: the parallel passes inside `f` (each GEMM, the attention) then start from a thread
/// of their pool rather than waking it from outside once each (about 11 us a GEMM on the
/// 2-core VM: 37 -> 26 us for a 2-token GEMM over a 1024 x 1024 weight).
pub fn on_a_pool_thread<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    rayon::scope(|_| f())
}

#[cfg(test)]
mod tests {
    #[test]
    fn work_put_on_a_pool_thread_runs_on_one_of_the_callers_pool() {
        assert_eq!(rayon::current_thread_index(), None, "the test's own thread is no pool's");
        assert!(super::on_a_pool_thread(rayon::current_thread_index).is_some(), "from outside: the global pool");
        let (pool, inside) = super::run(|| {
            (std::thread::current().name().map(String::from), super::on_a_pool_thread(|| std::thread::current().name().map(String::from)))
        });
        assert!(pool.as_deref().is_some_and(|n| n.starts_with("background-")));
        assert_eq!(inside, pool, "from a pool thread: that thread, on its own pool");
    }

    #[test]
    fn background_work_runs_on_lowered_threads_of_its_own() {
        let (name, nice) = super::run(|| {
            let name = std::thread::current().name().map(String::from);
            // SAFETY: getpriority reads the calling thread's nice value.
            #[cfg(target_os = "linux")]
            let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::syscall(libc::SYS_gettid) as libc::id_t) };
            #[cfg(not(target_os = "linux"))]
            let nice = super::BACKGROUND_NICE;
            (name, nice)
        });
        assert!(name.is_some_and(|n| n.starts_with("background-")));
        assert!(nice >= super::BACKGROUND_NICE, "nice {nice}");
        #[cfg(target_os = "linux")]
        {
            // SAFETY: sched_getscheduler reads the calling thread's policy (0: this thread).
            let policy = super::run(|| unsafe { libc::sched_getscheduler(0) });
            assert_eq!(policy, libc::SCHED_IDLE);
            let huge = super::run(crate::alloc::advises_on_this_thread);
            assert!(!huge, "background threads keep 4 KiB pages");
            assert!(crate::alloc::advises_on_this_thread());
        }
        // Serving threads keep their priority.
        assert!(!std::thread::current().name().is_some_and(|n| n.starts_with("background-")));
    }
}
