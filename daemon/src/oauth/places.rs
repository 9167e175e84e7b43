//! Places for requests to the issuer, shared fairly between clients.
//!
//! At most `total` requests run at once, at most `per_client` of one client's, and at most
//! `total - reserved` of clients that have failed lately: the last `reserved` places are
//! kept for clients that have not. A request that finds no place it may take waits in a
//! queue; a place that frees goes to a waiter whose client has not failed lately before
//! any whose client has, then to the one whose client has the fewest requests running
//! (the oldest of those first). So clients that keep every place they can get busy with
//! tokens the issuer refuses — from as many addresses as they like, at any issuer
//! latency — never make one that has not failed wait for them. A waiter gives up at its
//! deadline.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio::time::Instant;

/// The shared places; cheap to clone.
#[derive(Clone)]
pub struct Places(Arc<Shared>);

struct Shared {
    total: usize,
    per_client: usize,
    /// Places only clients that have not failed lately may take.
    reserved: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    running: usize,
    /// Of which for clients that have failed lately.
    failing: usize,
    /// Clients with a request running (none with zero).
    by_client: HashMap<IpAddr, usize>,
    waiting: Vec<Waiter>,
    next_seq: u64,
}

struct Waiter {
    client: IpAddr,
    /// Its client has failed lately: it waits behind those that have not.
    failing: bool,
    seq: u64,
    tx: oneshot::Sender<Place>,
}

/// A place held; freed (and handed on) when dropped.
pub struct Place {
    places: Places,
    client: IpAddr,
    failing: bool,
}

impl Inner {
    fn running_for(&self, client: &IpAddr) -> usize {
        self.by_client.get(client).copied().unwrap_or(0)
    }

    /// Whether `client` may take a place now.
    fn may_take(&self, shared: &Shared, client: &IpAddr, failing: bool) -> bool {
        self.running < shared.total
            && self.running_for(client) < shared.per_client
            && (!failing || self.failing < shared.total - shared.reserved)
    }

    fn take(&mut self, client: IpAddr, failing: bool) {
        self.running += 1;
        self.failing += usize::from(failing);
        *self.by_client.entry(client).or_default() += 1;
    }

    fn give_back(&mut self, client: IpAddr, failing: bool) {
        self.running = self.running.saturating_sub(1);
        self.failing = self.failing.saturating_sub(usize::from(failing));
        if let Some(n) = self.by_client.get_mut(&client) {
            *n -= 1;
            if *n == 0 {
                self.by_client.remove(&client);
            }
        }
    }
}

impl Places {
    /// `reserved` is capped below `total`.
    pub fn new(total: usize, per_client: usize, reserved: usize) -> Self {
        Self(Arc::new(Shared {
            total,
            per_client,
            reserved: reserved.min(total.saturating_sub(1)),
            inner: Mutex::new(Inner::default()),
        }))
    }

    /// A place for one of `client`'s requests, waiting until `deadline` at most; `failing`:
    /// the client has failed lately.
    pub async fn take(&self, client: IpAddr, failing: bool, deadline: Instant) -> Option<Place> {
        let rx = {
            let mut inner = self.0.inner.lock();
            // Waiters who gave up are dropped here, so the queue holds live ones only
            // (each holds a request's connection, which the listener bounds).
            inner.waiting.retain(|w| !w.tx.is_closed());
            if inner.may_take(&self.0, &client, failing) {
                inner.take(client, failing);
                return Some(self.place(client, failing));
            }
            let (tx, rx) = oneshot::channel();
            let seq = inner.next_seq;
            inner.next_seq += 1;
            inner.waiting.push(Waiter {
                client,
                failing,
                seq,
                tx,
            });
            rx
        };
        // A place sent just as the deadline passes is dropped with the receiver, and its
        // drop hands it on.
        tokio::time::timeout_at(deadline, rx).await.ok()?.ok()
    }

    fn place(&self, client: IpAddr, failing: bool) -> Place {
        Place {
            places: self.clone(),
            client,
            failing,
        }
    }

    /// `client`'s place is free: hand it to the first waiter in the order the module
    /// describes.
    fn release(&self, client: IpAddr, failing: bool) {
        let mut inner = self.0.inner.lock();
        inner.give_back(client, failing);
        inner.waiting.retain(|w| !w.tx.is_closed());
        let next = inner
            .waiting
            .iter()
            .enumerate()
            .filter(|(_, w)| inner.may_take(&self.0, &w.client, w.failing))
            .min_by_key(|(_, w)| (w.failing, inner.running_for(&w.client), w.seq))
            .map(|(i, _)| i);
        let Some(i) = next else {
            return;
        };
        let waiter = inner.waiting.swap_remove(i);
        inner.take(waiter.client, waiter.failing);
        drop(inner);
        // A waiter that gave up this instant drops the place, and that drop hands it on.
        let _ = waiter.tx.send(self.place(waiter.client, waiter.failing));
    }

    #[cfg(test)]
    fn running(&self) -> (usize, usize) {
        let inner = self.0.inner.lock();
        (inner.running, inner.waiting.len())
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.places.release(self.client, self.failing);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([198, 51, 100, n])
    }

    fn soon(ms: u64) -> Instant {
        Instant::now() + Duration::from_millis(ms)
    }

    #[tokio::test(start_paused = true)]
    async fn one_client_holds_at_most_its_share_and_waits_until_its_deadline() {
        let places = Places::new(4, 2, 0);
        let a = places.take(ip(1), false, soon(0)).await.expect("first");
        let b = places.take(ip(1), false, soon(0)).await.expect("second");
        let started = Instant::now();
        assert!(
            places.take(ip(1), false, soon(1000)).await.is_none(),
            "a third"
        );
        assert_eq!(started.elapsed(), Duration::from_millis(1000));
        // Another client still finds places.
        let c = places
            .take(ip(2), false, soon(0))
            .await
            .expect("another client");
        assert_eq!(places.running(), (3, 0), "the waiter that gave up is gone");
        drop((a, b, c));
        assert_eq!(places.running(), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_freed_place_goes_to_the_client_running_the_fewest() {
        let places = Places::new(4, 2, 0);
        let mut held = Vec::new();
        for client in [1, 1, 2, 2] {
            held.push(places.take(ip(client), false, soon(0)).await.unwrap());
        }
        // Client 3 asks after client 4 has queued twice; client 1 queues too.
        let p = places.clone();
        let four = tokio::spawn(async move { p.take(ip(4), false, soon(5000)).await });
        tokio::task::yield_now().await;
        let p = places.clone();
        let three = tokio::spawn(async move { p.take(ip(3), false, soon(5000)).await });
        tokio::task::yield_now().await;
        // Client 2 frees one: client 4 (none running, oldest) gets it.
        held.remove(3);
        let four = four.await.unwrap().expect("client 4 first");
        // Client 1 frees one: client 3 (none running) before anyone with one running.
        held.remove(0);
        let three = three.await.unwrap().expect("client 3 next");
        assert_eq!(places.running(), (4, 0));
        drop((four, three, held));
        assert_eq!(places.running(), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_has_not_failed_goes_before_every_one_that_has() {
        // Every place held by clients that fail, many more of them queued (one each, from
        // many addresses), then a client that has not failed asks.
        let places = Places::new(3, 1, 1);
        let mut held = vec![
            places.take(ip(1), true, soon(0)).await.unwrap(),
            places.take(ip(2), true, soon(0)).await.unwrap(),
            places.take(ip(3), false, soon(0)).await.unwrap(),
        ];
        // The last place is kept for clients that have not failed.
        assert!(places.take(ip(4), true, soon(100)).await.is_none());
        let mut queued = Vec::new();
        for n in 10..30 {
            let p = places.clone();
            queued.push(tokio::spawn(async move {
                p.take(ip(n), true, soon(5000)).await
            }));
            tokio::task::yield_now().await;
        }
        let p = places.clone();
        let clean = tokio::spawn(async move { p.take(ip(99), false, soon(5000)).await });
        tokio::task::yield_now().await;
        held.remove(0);
        let clean = clean
            .await
            .unwrap()
            .expect("the client that has not failed");
        assert!(queued.iter().all(|q| !q.is_finished()));
        // A place a client that has not failed frees goes to a waiter that has, up to
        // their share; the next stays free for one that has not, which takes it at once.
        let kept = held.pop().expect("ip(3)'s");
        drop(kept);
        tokio::task::yield_now().await;
        assert_eq!(queued.iter().filter(|q| q.is_finished()).count(), 1);
        drop(clean);
        tokio::task::yield_now().await;
        assert_eq!(queued.iter().filter(|q| q.is_finished()).count(), 1);
        let at_once = places
            .take(ip(98), false, soon(0))
            .await
            .expect("kept for it");
        drop((at_once, held));
        for q in queued {
            q.abort();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_at_its_share_is_skipped_for_another_client() {
        let places = Places::new(3, 2, 0);
        let a1 = places.take(ip(1), false, soon(0)).await.unwrap();
        let a2 = places.take(ip(1), false, soon(0)).await.unwrap();
        let b = places.take(ip(2), false, soon(0)).await.unwrap();
        let p = places.clone();
        let one = tokio::spawn(async move { p.take(ip(1), false, soon(5000)).await });
        tokio::task::yield_now().await;
        let p = places.clone();
        let two = tokio::spawn(async move { p.take(ip(2), false, soon(5000)).await });
        tokio::task::yield_now().await;
        // Client 2's place frees: client 1 is at its share, so client 2's waiter gets it.
        drop(b);
        let two = two.await.unwrap().expect("client 2's waiter");
        assert!(!one.is_finished());
        drop(a1);
        let one = one
            .await
            .unwrap()
            .expect("client 1's waiter, once under its share");
        drop((a2, one, two));
        assert_eq!(places.running(), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_place_nobody_waits_for_any_more_is_handed_on_not_lost() {
        let places = Places::new(1, 1, 0);
        let a = places.take(ip(1), false, soon(0)).await.unwrap();
        let p = places.clone();
        let gone = tokio::spawn(async move { p.take(ip(2), false, soon(10)).await });
        let p = places.clone();
        let waits = tokio::spawn(async move { p.take(ip(3), false, soon(5000)).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(gone.await.unwrap().is_none());
        drop(a);
        let c = waits.await.unwrap().expect("the live waiter");
        assert_eq!(places.running(), (1, 0));
        drop(c);
        assert_eq!(places.running(), (0, 0));
    }
}
