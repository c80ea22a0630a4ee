//! The daemon's async face on the keeper thread, in the actor style: one `async fn` per
//! request, each a message on a bounded queue with a `oneshot` reply, each wait bounded
//! by [`ANSWER_TIMEOUT`] so that a keeper busy elsewhere becomes a clear error, never a
//! stalled event loop. What `status` and a job's start ask waits far less: a keeper busy
//! with a million entries is read from its [`Board`].

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use hocus_control::status::CacheStatus;
use tokio::sync::{mpsc, oneshot};

use super::{
    board::Board,
    order::{Latest, Order, Progressing, Reconfigure},
};
use crate::{
    cache::relay::{Holding, Parent},
    observe::events::{Access, What},
    profile::{format::Profile, shortlist::Shortlist},
    redirect::{jobs::JobStart, mountns::Bind},
};

/// How long the daemon waits for the keeper to take or answer a request.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the keeper did not answer.
#[derive(Debug, thiserror::Error)]
pub enum KeeperError {
    #[error("the cache keeper has stopped")]
    Stopped,
    #[error("the cache keeper did not answer within {} s", ANSWER_TIMEOUT.as_secs())]
    Busy,
}

/// How long `status` waits for the keeper before showing what it last published.
const STATUS_WAIT: Duration = Duration::from_millis(20);
/// How long a job's start waits for the keeper before taking the binds on its board.
const BINDS_WAIT: Duration = Duration::from_millis(50);

/// The keeper's answer, if it comes within `wait`.
async fn within<T>(wait: Duration, answer: oneshot::Receiver<T>) -> Result<T, KeeperError> {
    match tokio::time::timeout(wait, answer).await {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(_)) => Err(KeeperError::Stopped),
        Err(_) => Err(KeeperError::Busy),
    }
}

/// Accesses held while the keeper's queue is full, at most; more are dropped (counted,
/// and said in the log): they only count hits and misses.
pub const MAX_HELD_ACCESSES: usize = 65_536;

/// Sends orders to the keeper; cheap to clone.
#[derive(Clone)]
pub struct Handle {
    orders: mpsc::Sender<Order>,
    latest: Latest,
    board: Arc<Board>,
    /// Accesses not yet queued (the queue was full), and how many were dropped.
    held: Arc<Mutex<(Vec<Access>, u64)>>,
}

impl Handle {
    pub(super) fn new(orders: mpsc::Sender<Order>, latest: Latest, board: Arc<Board>) -> Self {
        Self {
            orders,
            latest,
            board,
            held: Arc::default(),
        }
    }

    /// Like `ask`, waiting at most `wait` in all: the order is not queued if the queue is
    /// full.
    async fn ask_briefly<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Order,
        wait: Duration,
    ) -> Result<T, KeeperError> {
        let (reply, answer) = oneshot::channel();
        match self.orders.try_send(make(reply)) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => return Err(KeeperError::Busy),
            Err(mpsc::error::TrySendError::Closed(_)) => return Err(KeeperError::Stopped),
        }
        within(wait, answer).await
    }

    /// Queues an order that needs no answer; waits only while the queue is full. Accesses
    /// held are queued first, so that the keeper sees everything in order (a job's
    /// accesses before its end).
    async fn tell(&self, order: Order) -> Result<(), KeeperError> {
        let held = self.take_held();
        if !held.is_empty() {
            self.send(Order::Accesses(held)).await?;
        }
        self.send(order).await
    }

    async fn send(&self, order: Order) -> Result<(), KeeperError> {
        match tokio::time::timeout(ANSWER_TIMEOUT, self.orders.send(order)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(KeeperError::Stopped),
            Err(_) => Err(KeeperError::Busy),
        }
    }

    /// Sends the order `make` builds around a reply channel, and waits for the reply.
    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Order,
    ) -> Result<T, KeeperError> {
        let (reply, answer) = oneshot::channel();
        self.tell(make(reply)).await?;
        within(ANSWER_TIMEOUT, answer).await
    }

    /// Whether the last shortlist sent is still waiting for the keeper: a newer one would
    /// only replace it, and a site-wide shortlist is ~12 MiB to build and hold.
    pub fn shortlist_waiting(&self) -> bool {
        self.latest.lock().is_ok_and(|l| l.is_some())
    }

    /// The working set changed: place it again.
    pub async fn place(&self, shortlist: Shortlist) -> Result<(), KeeperError> {
        let queued = match self.latest.lock() {
            Ok(mut latest) => latest.replace(shortlist).is_some(),
            Err(_) => return Err(KeeperError::Stopped),
        };
        // Already queued: the keeper takes this newer one when it gets there.
        if queued {
            return Ok(());
        }
        let told = self.tell(Order::PlaceLatest).await;
        if told.is_err() {
            // Not queued after all: the next placement must queue its own.
            if let Ok(mut latest) = self.latest.lock() {
                latest.take();
            }
        }
        told
    }

    /// Places `profile` now; progress arrives on `progress` until it is finished.
    pub async fn prefetch(
        &self,
        profile: Profile,
        progress: Progressing,
        parent: Option<Arc<Parent>>,
    ) -> Result<(), KeeperError> {
        self.tell(Order::Prefetch(profile, progress, parent)).await
    }

    /// Where this node's copy of `source` is, for another node of a job.
    pub async fn local_copy(&self, source: String) -> Result<Holding, KeeperError> {
        self.ask(|reply| Order::LocalCopy(source, reply)).await
    }

    /// The tracer saw the file written, truncated, renamed or unlinked.
    pub async fn invalidate(&self, path: String) -> Result<(), KeeperError> {
        self.tell(Order::Invalidate(path)).await
    }

    /// A change on a watched tree could not be placed: every copy is checked now.
    pub async fn revalidate_now(&self) -> Result<(), KeeperError> {
        self.tell(Order::RevalidateNow).await
    }

    /// A job tried to write the file through its read-only copy.
    pub async fn refused(&self, path: String) -> Result<(), KeeperError> {
        self.tell(Order::Refused(path)).await
    }

    /// A process opened, failed to find or read a watched file.
    /// What one read of the kernel side found: queued as one order, never waited for.
    /// While the keeper's queue is full (the keeper busy with a million entries), they are
    /// held here and go with the next order. Where reads lay (`What::Grains`) is not the
    /// keeper's: it counts what served them, from their bytes.
    pub fn accesses(&self, mut accesses: Vec<Access>) -> Result<(), KeeperError> {
        accesses.retain(|a| !matches!(a.what, What::Grains(..)));
        let mut held = self.take_held();
        if held.is_empty() && accesses.is_empty() {
            return Ok(());
        }
        held.append(&mut accesses);
        match self.orders.try_send(Order::Accesses(held)) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Closed(_)) => Err(KeeperError::Stopped),
            Err(mpsc::error::TrySendError::Full(Order::Accesses(mut back))) => {
                let mut kept = self.held.lock().unwrap_or_else(|e| e.into_inner());
                let over = back.len().saturating_sub(MAX_HELD_ACCESSES);
                if over > 0 {
                    if kept.1 == 0 {
                        log::warn!(
                            "the cache keeper is busy and {MAX_HELD_ACCESSES} accesses wait for it: more are not counted as hits or misses until it catches up"
                        );
                    }
                    kept.1 += over as u64;
                    back.truncate(MAX_HELD_ACCESSES);
                }
                kept.0 = back;
                Ok(())
            }
            Err(mpsc::error::TrySendError::Full(_)) => unreachable!("sent accesses"),
        }
    }

    /// Accesses dropped because the keeper was busy (since start).
    pub fn accesses_dropped(&self) -> u64 {
        self.held.lock().map_or(0, |h| h.1)
    }

    fn take_held(&self) -> Vec<Access> {
        std::mem::take(&mut self.held.lock().unwrap_or_else(|e| e.into_inner()).0)
    }

    pub async fn reconfigure(&self, r: Reconfigure) -> Result<(), KeeperError> {
        self.tell(Order::Reconfigure(r)).await
    }

    /// New budgets in bytes; pins and copies beyond them are released.
    pub async fn set_budgets(&self, ssd: Option<u64>, ram: Option<u64>) -> Result<(), KeeperError> {
        self.tell(Order::Budgets { ssd, ram }).await
    }

    /// Its status now, with where each of `paths` is held ("ram", "ssd" or
    /// "network"); or, if it is busy (a million entries placed), its status as it last
    /// published it, and no paths.
    pub async fn status(
        &self,
        paths: Vec<String>,
    ) -> Result<(CacheStatus, Vec<String>), KeeperError> {
        match self
            .ask_briefly(|reply| Order::Status(paths, reply), STATUS_WAIT)
            .await
        {
            Err(KeeperError::Busy) => {
                let status = self.board.status().ok_or(KeeperError::Busy)?;
                Ok((status, Vec::new()))
            }
            answered => answered,
        }
    }

    /// The binds a new job's namespace gets: from the keeper, or if it is busy, from its
    /// board.
    pub async fn binds(&self) -> Result<Vec<Bind>, KeeperError> {
        match self.ask_briefly(Order::Binds, BINDS_WAIT).await {
            Err(KeeperError::Busy) => match self.board.binds() {
                Some(binds) => Ok(binds),
                None => self.ask(Order::Binds).await,
            },
            answered => answered,
        }
    }

    /// A job starts (its overlays and task taken by the daemon already). Not waited for:
    /// the keeper takes orders in turn, so it follows the job before any of its opens.
    pub async fn job_starting(&self, job: JobStart) -> Result<(), KeeperError> {
        self.tell(Order::JobStarting(job)).await
    }

    pub async fn job_ended(&self, id: u32) -> Result<(), KeeperError> {
        self.tell(Order::JobEnded { id }).await
    }

    /// Asks the keeper to stop: it saves its index and releases its pins.
    pub async fn stop(&self) {
        let _ = self.tell(Order::Stop).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::format::FileEntry;

    #[tokio::test]
    async fn a_keeper_behind_on_placements_gets_one_order_for_the_newest() {
        let (tx, mut rx) = mpsc::channel(4);
        let handle = Handle::new(tx, Latest::default(), Arc::default());
        // The keeper is busy: a hundred placements arrive (a storm of events) ...
        for n in 0..100 {
            let shortlist = Shortlist::of_files(&vec![FileEntry::default(); n]);
            handle.place(shortlist).await.unwrap();
        }
        // ... and it finds one order, for the newest, leaving the queue to questions.
        assert!(matches!(rx.try_recv(), Ok(Order::PlaceLatest)));
        assert!(rx.try_recv().is_err());
        assert!(handle.shortlist_waiting());
        let newest = handle.latest.lock().unwrap().take().unwrap();
        assert!(!handle.shortlist_waiting());
        assert_eq!(newest.len(), 99);
        // Once taken, the next placement queues an order again.
        handle.place(Shortlist::default()).await.unwrap();
        assert!(matches!(rx.try_recv(), Ok(Order::PlaceLatest)));
    }

    #[tokio::test]
    async fn accesses_never_wait_for_a_full_queue_and_go_first_with_the_next_order() {
        use crate::observe::events::What;
        let (tx, mut rx) = mpsc::channel(2);
        let handle = Handle::new(tx, Latest::default(), Arc::default());
        let access = |n: usize| Access {
            path: format!("/net/{n}"),
            job: 0,
            process: Default::default(),
            what: What::Open,
            uid: 0,
            at_ns: n as u64,
        };
        let paths = |order: Option<Order>| match order {
            Some(Order::Accesses(a)) => a.iter().map(|a| a.at_ns as usize).collect::<Vec<_>>(),
            _ => panic!("not accesses"),
        };
        // A keeper busy elsewhere: two reads fill its queue, the next ones are held,
        // at once, up to the bound; the newest beyond it are dropped and counted.
        handle.accesses(vec![access(0)]).unwrap();
        handle.accesses(vec![access(1)]).unwrap();
        handle.accesses(vec![access(2), access(3)]).unwrap();
        handle
            .accesses((4..4 + MAX_HELD_ACCESSES).map(access).collect())
            .unwrap();
        assert_eq!(handle.accesses_dropped(), 2);
        // Nothing new, nothing sent.
        assert_eq!(paths(rx.recv().await), vec![0]);
        assert_eq!(paths(rx.recv().await), vec![1]);
        assert!(rx.try_recv().is_err());
        // The next order goes after what was held, in order.
        handle.invalidate("/net/x".into()).await.unwrap();
        let held = paths(rx.recv().await);
        assert_eq!(held.len(), MAX_HELD_ACCESSES);
        assert_eq!(
            (held[0], held[MAX_HELD_ACCESSES - 1]),
            (2, MAX_HELD_ACCESSES + 1)
        );
        assert!(matches!(rx.recv().await, Some(Order::Invalidate(p)) if p == "/net/x"));
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn a_busy_keeper_s_status_is_what_it_last_published() {
        // A keeper that never answers (busy with a million entries).
        let (tx, _rx) = mpsc::channel(4);
        let board = Arc::new(Board::default());
        let handle = Handle::new(tx, Latest::default(), board.clone());
        // Nothing published yet: said busy, at once.
        let t = std::time::Instant::now();
        assert!(matches!(
            handle.status(Vec::new()).await,
            Err(KeeperError::Busy)
        ));
        board.write_status(CacheStatus {
            cached_files: 7,
            ..CacheStatus::default()
        });
        let (status, held) = handle.status(vec!["/a".into()]).await.unwrap();
        assert_eq!(status.cached_files, 7);
        assert!(held.is_empty());
        // A job's start takes the binds on the board.
        board.write_binds(vec![Bind {
            local: "/cache/a".into(),
            target: "/net/a".into(),
            tree: "/net".into(),
            expect: Default::default(),
            lazy: false,
            passages: Vec::new(),
        }]);
        assert_eq!(
            handle.binds().await.unwrap()[0].target.to_str(),
            Some("/net/a")
        );
        // Each waited its brief bound, not ANSWER_TIMEOUT.
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }
}
