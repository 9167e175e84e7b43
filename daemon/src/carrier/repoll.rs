//! A connection's task polled again at once when it is woken while it runs, instead of
//! going back through the scheduler.
//!
//! hyper 1.12's HTTP/1.1 request body wakes the connection's task each time the handler
//! takes a chunk, with the waker the connection registered before the body was read —
//! after the body is whole too (`hyper::body::chan::Receiver::poll_next`). The handler
//! runs inside the connection's task, so every request with a body woke its own task
//! while it was running. tokio then yields the task: it goes to the back of the worker's
//! queue and a sleeping worker is woken to steal it (one `futex` wake and two context
//! switches of the other worker per request at one client, for a poll that finds nothing
//! to do). A wake-up that arrives while [`Repoll`] polls its future is kept, and the
//! future polled again at once (once more at most, then the scheduler decides); any other
//! wake-up reaches the task as usual.
//!
//! Every wake-up that reaches the task also clears the connection's mark that it is
//! waiting on its peer (set when its last read found nothing): the wake-up may be its
//! peer's bytes, arrived and not read yet, and until its task has read them the
//! connection must not look idle to eviction.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

/// Polls of the future per poll of the task when every one of them was woken again: one
/// more is enough for the body channel's wake-up, and a future that keeps waking itself
/// on purpose (hyper yields a connection after 16 turns in a row, tokio's budget makes a
/// task that used it up wake itself) still goes back to the scheduler after at most twice
/// its own turn.
const POLLS: usize = 2;

/// `F`, polled again at once when it is woken while being polled; `waiting` cleared at
/// every wake-up that goes to the scheduler.
pub struct Repoll<F> {
    future: Pin<Box<F>>,
    signal: Arc<Signal>,
    waker: Waker,
}

/// What `F` wakes: while it is being polled, a mark; otherwise the task.
struct Signal {
    state: AtomicU8,
    task: AtomicWaker,
    waiting: Arc<AtomicBool>,
}

const POLLING: u8 = 1;
const WOKEN: u8 = 2;

impl<F: Future> Repoll<F> {
    pub fn new(future: F, waiting: Arc<AtomicBool>) -> Self {
        let signal = Arc::new(Signal {
            state: AtomicU8::new(0),
            task: AtomicWaker::new(),
            waiting,
        });
        Self {
            future: Box::pin(future),
            waker: Waker::from(signal.clone()),
            signal,
        }
    }
}

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if self.state.fetch_or(WOKEN, Ordering::AcqRel) & POLLING == 0 {
            self.waiting.store(false, Ordering::Relaxed);
            self.task.wake();
        }
    }
}

impl<F: Future> Future for Repoll<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        this.signal.task.register(cx.waker());
        let mut inner = Context::from_waker(&this.waker);
        for _ in 0..POLLS {
            this.signal.state.store(POLLING, Ordering::Release);
            let polled = this.future.as_mut().poll(&mut inner);
            // From here a wake-up reaches the task again.
            let state = this.signal.state.swap(0, Ordering::AcqRel);
            if polled.is_ready() || state & WOKEN == 0 {
                return polled;
            }
        }
        this.signal.waiting.store(false, Ordering::Relaxed);
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Counts the wake-ups that reach the task.
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A task's waker, and how many times it was woken.
    fn task() -> (Arc<Count>, Waker) {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        (count.clone(), Waker::from(count))
    }

    /// A future that wakes itself while polled `selfish` times, then is ready after
    /// `ready_at` polls (or never), keeping the last waker it was given; each poll finds
    /// nothing to read from its peer (`waiting` set, as a connection's read would).
    struct Selfish {
        polls: usize,
        selfish: usize,
        ready_at: Option<usize>,
        last: Arc<parking_lot::Mutex<Option<Waker>>>,
        waiting: Arc<AtomicBool>,
    }

    impl Future for Selfish {
        type Output = usize;
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<usize> {
            self.polls += 1;
            self.waiting.store(true, Ordering::SeqCst);
            *self.last.lock() = Some(cx.waker().clone());
            if Some(self.polls) == self.ready_at {
                return Poll::Ready(self.polls);
            }
            if self.polls <= self.selfish {
                cx.waker().wake_by_ref();
            }
            Poll::Pending
        }
    }

    type Kept = Arc<parking_lot::Mutex<Option<Waker>>>;

    fn selfish(
        selfish: usize,
        ready_at: Option<usize>,
    ) -> (Repoll<Selfish>, Kept, Arc<AtomicBool>) {
        let last = Arc::new(parking_lot::Mutex::new(None));
        let waiting = Arc::new(AtomicBool::new(false));
        let future = Selfish {
            polls: 0,
            selfish,
            ready_at,
            last: last.clone(),
            waiting: waiting.clone(),
        };
        (Repoll::new(future, waiting.clone()), last, waiting)
    }

    #[test]
    fn a_wake_up_during_the_poll_polls_again_without_the_task() {
        let (count, task) = task();
        let mut cx = Context::from_waker(&task);
        let (mut repoll, _, waiting) = selfish(1, Some(2));
        assert_eq!(Pin::new(&mut repoll).poll(&mut cx), Poll::Ready(2));
        assert_eq!(count.0.load(Ordering::SeqCst), 0);
        assert!(
            waiting.load(Ordering::SeqCst),
            "the second poll looked again"
        );
    }

    #[test]
    fn a_future_that_keeps_waking_itself_goes_back_to_the_scheduler() {
        let (count, task) = task();
        let mut cx = Context::from_waker(&task);
        let (mut repoll, _, waiting) = selfish(usize::MAX, None);
        assert!(Pin::new(&mut repoll).poll(&mut cx).is_pending());
        assert_eq!(repoll.future.polls, POLLS);
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert!(
            !waiting.load(Ordering::SeqCst),
            "woken after its last look: not waiting until it looks again"
        );
    }

    #[test]
    fn a_wake_up_after_the_poll_reaches_the_task() {
        let (count, task) = task();
        let mut cx = Context::from_waker(&task);
        let (mut repoll, last, waiting) = selfish(0, None);
        assert!(Pin::new(&mut repoll).poll(&mut cx).is_pending());
        assert_eq!(count.0.load(Ordering::SeqCst), 0);
        assert!(waiting.load(Ordering::SeqCst));
        let kept = last
            .lock()
            .take()
            .unwrap_or_else(|| panic!("no waker kept"));
        kept.wake_by_ref();
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert!(
            !waiting.load(Ordering::SeqCst),
            "a wake-up may be the peer's bytes"
        );
        // From another thread too.
        assert!(Pin::new(&mut repoll).poll(&mut cx).is_pending());
        let kept = last
            .lock()
            .take()
            .unwrap_or_else(|| panic!("no waker kept"));
        std::thread::spawn(move || kept.wake())
            .join()
            .unwrap_or_else(|_| panic!("waking thread panicked"));
        assert_eq!(count.0.load(Ordering::SeqCst), 2);
        assert!(!waiting.load(Ordering::SeqCst));
    }
}
