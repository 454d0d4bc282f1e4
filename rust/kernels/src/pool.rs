//! A persistent pool of worker threads for the kernels' parallel loops.
//!
//! Decode calls are short (20-200 us for SmolLM2's GEMVs), and spawning a thread costs about
//! 50 us on this machine class: with a scoped thread per call, a second thread made the
//! batch-1 decode step slower than one thread. Workers here are spawned once (lazily, as
//! many as the largest call asks for), spin for a short while after each job so the next
//! call of the same step finds them awake, then park until woken.
//!
//! [`parallel`] runs `f(0)` on the calling thread and `f(1..parts)` on workers, and returns
//! when all have run. Calls from several threads are serialized.
//!
//! A forked child (Python's multiprocessing forks) gets fresh workers on its first call: the
//! parent's threads do not exist in it.
//!
//! Invariants: a job's closure is only called while its `parallel` call is waiting for it
//! (the call returns only after every part has run), so borrowing non-'static data is
//! sound; each part runs exactly once, because a worker reads the job, its epoch and its part
//! count together under the dispatch lock and runs only parts of the epoch it read.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long a worker keeps polling for the next job before it parks. A decode step calls the
/// kernels every few tens of microseconds; parking in between costs a wake-up (~10-50 us).
const SPIN: Duration = Duration::from_micros(300);

/// Workers never exceed this; `parallel` caps its parts to one more.
const MAX_WORKERS: usize = 63;

type Job = *const (dyn Fn(usize) + Sync);

struct Dispatch {
    epoch: usize,
    parts: usize,
    job: Option<Job>,
}

// SAFETY: the raw job pointer is only dereferenced while its `parallel` call keeps the closure
// alive (see the module invariants).
unsafe impl Send for Dispatch {}

struct Worker {
    thread: Thread,
    sleeping: AtomicBool,
}

struct Pool {
    /// Serializes `parallel` calls.
    call: Mutex<()>,
    dispatch: Mutex<Dispatch>,
    /// Mirrors `dispatch.epoch`, polled without the lock.
    epoch: AtomicUsize,
    /// Parts of the current job not yet done.
    pending: AtomicUsize,
    panicked: AtomicBool,
    /// The process the workers belong to: a forked child has none of its parent's threads.
    workers: Mutex<(u32, Vec<&'static Worker>)>,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool {
        call: Mutex::new(()),
        dispatch: Mutex::new(Dispatch { epoch: 0, parts: 0, job: None }),
        epoch: AtomicUsize::new(0),
        pending: AtomicUsize::new(0),
        panicked: AtomicBool::new(false),
        workers: Mutex::new((std::process::id(), Vec::new())),
    })
}

/// Runs `f(i)` for every `i` in `0..parts` (at most 64 parts; more are an error of the
/// caller, capped here), `f(0)` on this thread; returns when all have returned. A panic in a
/// worker's part is re-raised here.
pub(crate) fn parallel(parts: usize, f: &(dyn Fn(usize) + Sync)) {
    let parts = parts.clamp(1, MAX_WORKERS + 1);
    if parts == 1 {
        f(0);
        return;
    }
    let pool = pool();
    let _call = pool.call.lock().unwrap_or_else(|e| e.into_inner());
    let workers = pool.ensure_workers(parts - 1);
    // SAFETY: erasing the lifetime is sound because this function does not return before
    // every worker part has finished with `f` (the wait on `pending` below).
    let job: Job = unsafe { std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), Job>(f) };
    pool.pending.store(parts - 1, Ordering::SeqCst);
    {
        let mut d = pool.dispatch.lock().unwrap_or_else(|e| e.into_inner());
        d.epoch += 1;
        d.parts = parts;
        d.job = Some(job);
        pool.epoch.store(d.epoch, Ordering::SeqCst);
    }
    for w in &workers[..parts - 1] {
        if w.sleeping.load(Ordering::SeqCst) {
            w.thread.unpark();
        }
    }
    f(0);
    let mut spins = 0u32;
    while pool.pending.load(Ordering::Acquire) != 0 {
        spins += 1;
        if spins < 1 << 14 {
            std::hint::spin_loop();
        } else {
            // A worker was descheduled: let it have the core.
            std::thread::yield_now();
        }
    }
    pool.dispatch.lock().unwrap_or_else(|e| e.into_inner()).job = None;
    if pool.panicked.swap(false, Ordering::SeqCst) {
        panic!("a kernel worker thread panicked");
    }
}

impl Pool {
    /// The first `n` workers, spawning any missing. Called under the `call` lock, before the
    /// next job is published.
    fn ensure_workers(&'static self, n: usize) -> Vec<&'static Worker> {
        let mut guard = self.workers.lock().unwrap_or_else(|e| e.into_inner());
        let (pid, workers) = &mut *guard;
        if *pid != std::process::id() {
            // Forked: the parent's workers do not exist here (their records are leaked).
            *pid = std::process::id();
            workers.clear();
        }
        while workers.len() < n {
            let index = workers.len() + 1;
            // The epoch before the job this worker is spawned for: read here, not by the new
            // thread, which may first run after that job was published (it would then wait
            // for the job after it, and the caller for it forever).
            let seen = self.epoch.load(Ordering::SeqCst);
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::Builder::new()
                .name(format!("llmserve-kernel-{index}"))
                .spawn(move || {
                    let me: &'static Worker = Box::leak(Box::new(Worker {
                        thread: std::thread::current(),
                        sleeping: AtomicBool::new(false),
                    }));
                    tx.send(me).expect("pool waits for its worker");
                    self.work(index, me, seen);
                })
                .expect("spawning a kernel worker thread");
            workers.push(rx.recv().expect("worker starts"));
        }
        workers[..n].to_vec()
    }

    /// A worker's loop: wait for a new epoch, run its part if the job has one for it.
    fn work(&self, index: usize, me: &Worker, mut seen: usize) {
        loop {
            self.wait_for_epoch_after(seen, me);
            let (epoch, parts, job) = {
                let d = self.dispatch.lock().unwrap_or_else(|e| e.into_inner());
                (d.epoch, d.parts, d.job)
            };
            seen = epoch;
            let (Some(job), true) = (job, index < parts) else { continue };
            // SAFETY: the job's `parallel` call is waiting for this part (module invariants).
            let f = unsafe { &*job };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(index))).is_err() {
                self.panicked.store(true, Ordering::SeqCst);
            }
            self.pending.fetch_sub(1, Ordering::Release);
        }
    }

    fn wait_for_epoch_after(&self, seen: usize, me: &Worker) {
        let start = Instant::now();
        let mut spins = 0u32;
        while self.epoch.load(Ordering::Acquire) == seen {
            spins = spins.wrapping_add(1);
            if spins & 63 != 0 || start.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            // Park; the caller unparks sleeping workers after publishing a job. The flag is
            // set before the last check, so a job published in between is not missed (an
            // unpark before park makes park return at once).
            me.sleeping.store(true, Ordering::SeqCst);
            if self.epoch.load(Ordering::SeqCst) == seen {
                std::thread::park();
            }
            me.sleeping.store(false, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_runs_once_on_distinct_threads() {
        for parts in [1usize, 2, 3, 8, 2, 5] {
            let hits: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
            let threads = Mutex::new(std::collections::HashSet::new());
            parallel(parts, &|i| {
                hits[i].fetch_add(1, Ordering::SeqCst);
                threads.lock().unwrap().insert(std::thread::current().id());
            });
            assert!(hits.iter().all(|h| h.load(Ordering::SeqCst) == 1), "parts {parts}");
            assert_eq!(threads.lock().unwrap().len(), parts);
        }
    }

    #[test]
    fn calls_from_many_threads_and_after_workers_park() {
        std::thread::scope(|s| {
            for t in 0..4 {
                s.spawn(move || {
                    for round in 0..200 {
                        let sum = AtomicUsize::new(0);
                        parallel(2 + (t + round) % 3, &|i| {
                            sum.fetch_add(i + 1, Ordering::SeqCst);
                        });
                        let parts = 2 + (t + round) % 3;
                        assert_eq!(sum.load(Ordering::SeqCst), parts * (parts + 1) / 2);
                    }
                });
            }
        });
        // Workers park after SPIN; a later call wakes them.
        std::thread::sleep(SPIN * 4);
        let sum = AtomicUsize::new(0);
        parallel(3, &|i| {
            sum.fetch_add(i, Ordering::SeqCst);
        });
        assert_eq!(sum.load(Ordering::SeqCst), 3);
    }

    /// New workers join the very call that spawns them, however late their threads start
    /// (each call here needs one more worker than any before it).
    #[test]
    fn new_workers_run_the_job_they_were_spawned_for() {
        for parts in 2..12 {
            let n = AtomicUsize::new(0);
            parallel(parts, &|_| {
                n.fetch_add(1, Ordering::SeqCst);
            });
            assert_eq!(n.load(Ordering::SeqCst), parts);
        }
    }

    #[test]
    fn a_panicking_part_is_reraised_and_the_pool_keeps_working() {
        let r = std::panic::catch_unwind(|| {
            parallel(2, &|i| {
                if i == 1 {
                    panic!("boom");
                }
            })
        });
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        parallel(2, &|_| {
            n.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(n.load(Ordering::SeqCst), 2);
    }
}
