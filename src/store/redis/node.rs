//! The health of one Redis server as this replica sees it, waiting for its answers, and the lane of
//! requests waiting to be sent to it (see `coalesce`).
//!
//! A call waits for its answer until the caller's answer is due ([`Node::wait`]); while it waits, answers
//! to any other call count as signs of life. Only a server that answers nothing at all for
//! `unresponsive_after` while commands wait for it is declared unresponsive (a hung process, a paused or
//! stopped one, a lost connection), which opens its breaker so that later calls are answered at once. A
//! burst that makes answers queue never does: answers keep arriving.
//!
//! Every command is watched until it ends, also after its caller stopped waiting: a command the caller
//! gave up on is handed to a background task (see [`Watched`]), so that its answer, or its silence, still
//! tells whether the server lives. Commands end at the latest after the client's command timeout, which
//! also keeps a command that was never written from being replayed after a reconnect.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        Arc,
    },
    task::{Context, Poll},
    time::Duration,
};

use fred::{
    clients::Pool,
    error::{Error, ErrorKind},
};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use super::{
    super::{breaker::Breaker, StoreError},
    backend::lock,
    coalesce::Lane,
};

/// One Redis server: its breaker, the signs of life seen from it, and the parts waiting for its next
/// call.
#[derive(Debug)]
pub struct Node {
    /// `host:port`, for logs.
    name: String,
    pub breaker: Breaker,
    pub lane: Lane,
    unresponsive_after: Duration,
    /// Reference point of the millisecond clocks below.
    epoch: Instant,
    /// Commands sent to the server and not ended yet (answered, failed or given up by the client).
    outstanding: AtomicUsize,
    /// When the server last showed progress (ms since `epoch`): its last answer, or the moment a
    /// command started waiting while none was outstanding.
    progress_ms: AtomicU64,
    /// A lost connection's check is under way ([`Node::connection_lost`]).
    checking: AtomicBool,
    /// Until when (ms since `epoch`) calls finding no connection up wait for the client's rather than
    /// open the breaker: the server took a new connection after closing ours, or a Cluster master's
    /// own connections are first being made.
    accepting_until_ms: AtomicU64,
    /// A Cluster master's own connections, which carry its calls (see `Backend::master_node`).
    direct: Option<Pool>,
    /// No longer a master, or a second entry made for one: its connections are closed.
    retired: AtomicBool,
    /// The connection tasks of its own clients, ended when it is retired.
    tasks: std::sync::Mutex<Vec<tokio::task::AbortHandle>>,
    /// It takes connections and commands but refuses every key: a Cluster that lost all copies of some
    /// slots answers CLUSTERDOWN. Its breaker stays open until a call is decided again.
    refusing: AtomicBool,
}

impl Node {
    pub fn new(
        name: String,
        breaker: Breaker,
        unresponsive_after: Duration,
        direct: Option<Pool>,
    ) -> Self {
        Self {
            name,
            breaker,
            lane: Lane::default(),
            unresponsive_after,
            epoch: Instant::now(),
            outstanding: AtomicUsize::new(0),
            progress_ms: AtomicU64::new(0),
            checking: AtomicBool::new(false),
            // A master's own connections are being made: its first calls wait for them.
            accepting_until_ms: AtomicU64::new(if direct.is_some() { RECONNECTING_MS } else { 0 }),
            direct,
            retired: AtomicBool::new(false),
            tasks: std::sync::Mutex::new(Vec::new()),
            refusing: AtomicBool::new(false),
        }
    }

    /// Keeps a connection task of one of its own clients, to end it when retired (at once if it is).
    pub fn own_task(&self, task: tokio::task::AbortHandle) {
        let mut tasks = lock(&self.tasks);
        if self.is_retired() {
            task.abort();
        } else {
            tasks.retain(|t| !t.is_finished());
            tasks.push(task);
        }
    }

    /// Whether its connections are being made: again, after it closed them while it took new ones
    /// (see [`Node::connection_lost`]), or for the first time on a Cluster master; none refused since.
    pub fn reconnecting(&self) -> bool {
        self.now_ms() < self.accepting_until_ms.load(Ordering::Relaxed)
    }

    /// A connection to it was refused: it no longer counts as taking new ones.
    pub fn refused(&self) {
        self.accepting_until_ms.store(0, Ordering::Relaxed);
    }

    /// Its own connections, on a Cluster master not retired (a retired one's calls go through the
    /// Cluster client).
    pub fn direct(&self) -> Option<&Pool> {
        self.direct.as_ref().filter(|_| !self.is_retired())
    }

    /// Closes its own connections for good: it is no longer a master (or not the entry kept for one).
    pub fn retire(&self) {
        if self.retired.swap(true, Ordering::AcqRel) {
            return;
        }
        // The connection tasks are ended, not asked to quit: a quit that lands while a client is
        // connecting is lost on it, and the client goes on reconnecting for good.
        for task in lock(&self.tasks).drain(..) {
            task.abort();
        }
    }

    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The moment the server counts as unresponsive if it answers nothing before it.
    fn silent_deadline(&self) -> Instant {
        self.epoch
            + Duration::from_millis(self.progress_ms.load(Ordering::Relaxed))
            + self.unresponsive_after
    }

    /// Whether commands wait and nothing came back for `unresponsive_after`.
    fn is_silent(&self) -> bool {
        self.outstanding.load(Ordering::Relaxed) > 0 && Instant::now() >= self.silent_deadline()
    }

    /// Returns once the server has been silent for `unresponsive_after` while commands waited. Judged on
    /// this process's own time: when it was itself kept from running (a starved machine), answers may
    /// sit unread, so it looks again once it has run for a moment.
    async fn silence(&self) {
        /// Lateness of a timer that says this process was not running, rather than the server silent.
        const STARVED: Duration = Duration::from_millis(20);
        loop {
            let silent = self.silent_deadline();
            tokio::time::sleep_until(silent).await;
            if Instant::now().saturating_duration_since(silent) > STARVED {
                tokio::time::sleep(STARVED).await;
            }
            // Let a reply that has arrived be read before judging.
            tokio::task::yield_now().await;
            if self.is_silent() {
                return;
            }
        }
    }

    fn started(&self) {
        if self.outstanding.fetch_add(1, Ordering::Relaxed) == 0 {
            // Nothing was waiting: the silence is measured from now, not from the last answer.
            self.progress_ms.fetch_max(self.now_ms(), Ordering::Relaxed);
        }
    }

    /// Records how a command ended; the server answered unless the error is the connection's.
    fn ended<R>(&self, result: &Result<R, Error>) {
        self.outstanding.fetch_sub(1, Ordering::Relaxed);
        match result {
            Ok(_) => self.answered(),
            Err(err) if is_answer(err) => self.answered(),
            Err(err) if is_cluster_down(err) => self.cluster_down(err),
            Err(err) => {
                if self.breaker.failure() {
                    tracing::warn!(
                        server = %self.name,
                        "Redis failing ({err}): circuit breaker open"
                    );
                }
            }
        }
    }

    /// Records that the server answered a command: it serves.
    pub fn answered(&self) {
        self.progress_ms.fetch_max(self.now_ms(), Ordering::Relaxed);
        self.refusing.store(false, Ordering::Relaxed);
        if self.breaker.success() {
            tracing::warn!(server = %self.name, "Redis answering again: circuit breaker closed");
        }
    }

    /// Records that a new connection took the scripts: the server is back, unless it was refusing every
    /// key, which only a decided call tells is over (the Redis client makes a new connection after
    /// each CLUSTERDOWN reply).
    pub fn reconnected(&self) {
        if self.refusing.load(Ordering::Relaxed) {
            self.progress_ms.fetch_max(self.now_ms(), Ordering::Relaxed);
        } else {
            self.answered();
        }
    }

    /// The server refused a command or a connection with CLUSTERDOWN: its breaker opens at once and
    /// stays open, its probes refused without a line each, until a call is decided again.
    pub fn cluster_down(&self, err: &Error) {
        self.progress_ms.fetch_max(self.now_ms(), Ordering::Relaxed);
        self.breaker.trip();
        if !self.refusing.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                server = %self.name,
                "Redis Cluster refusing every key ({err}): circuit breaker open until it serves again"
            );
        }
    }

    /// The server closed a connection of ours (`why`). That alone says little: an idle timeout (Redis's
    /// `timeout`, a proxy's) or a `CLIENT KILL` closes connections of a healthy server, a crash or a
    /// restart those of a dead one. So it is asked at once, with one new connection of our own to
    /// `target`, one check at a time whatever the number of connections lost together: refused, or not
    /// accepted within `unresponsive_after`, the breaker opens at once (the calls that would wait for a
    /// reconnection are answered without waiting); accepted, the client's own reconnection goes on and
    /// nothing is counted against the server.
    pub fn connection_lost(self: &Arc<Self>, target: Probe, why: String) {
        if self.checking.swap(true, Ordering::AcqRel) {
            return;
        }
        let node = self.clone();
        tokio::spawn(async move {
            let accepted = tokio::time::timeout(node.unresponsive_after, target.connect()).await;
            node.checking.store(false, Ordering::Release);
            let refused = match accepted {
                Ok(Ok(())) => {
                    node.accepting_until_ms
                        .store(node.now_ms() + RECONNECTING_MS, Ordering::Relaxed);
                    tracing::debug!(server = %node.name, "Redis closed a connection ({why}) and accepts new ones: reconnecting");
                    return;
                }
                Ok(Err(err)) => err.to_string(),
                Err(_) => format!(
                    "no new connection accepted within {:?}",
                    node.unresponsive_after
                ),
            };
            if node.breaker.trip() {
                tracing::warn!(
                    server = %node.name,
                    "Redis connection lost ({why}) and a new one refused ({refused}): circuit breaker open"
                );
            }
        });
    }

    /// Opens the breaker: the server answers nothing although commands wait.
    fn unresponsive(&self) {
        if self.breaker.trip() {
            tracing::warn!(
                server = %self.name,
                "Redis unresponsive: no answer at all for {:?} while commands waited; circuit breaker open",
                self.unresponsive_after
            );
        }
    }

    /// Sends `call` (already built, not yet polled) and waits for its answer until `until`, or until the
    /// server is found unresponsive. `late` is the error for a deadline that passes first.
    ///
    /// The call is boxed at once, before the wait's own future is made: a client's command future is
    /// several kilobytes, and held inline it would make every future awaiting this one (a lane's task
    /// among them) that much larger, to allocate and to copy as it moves.
    pub fn wait<R: Send + 'static>(
        self: &Arc<Self>,
        tasks: &TaskTracker,
        call: impl Future<Output = Result<R, Error>> + Send + 'static,
        until: Instant,
        late: StoreError,
    ) -> impl Future<Output = Result<Result<R, Error>, StoreError>> + Send + 'static {
        self.wait_boxed(tasks, Box::pin(call), until, late, None)
    }

    /// [`Node::wait`] for a call its caller has boxed already (one of several kinds); `on_late` is
    /// given the answer if it comes after the wait ended.
    pub fn wait_boxed<R: Send + 'static>(
        self: &Arc<Self>,
        tasks: &TaskTracker,
        call: BoxedCall<R>,
        until: Instant,
        late: StoreError,
        on_late: Option<LateAnswer<R>>,
    ) -> impl Future<Output = Result<Result<R, Error>, StoreError>> + Send + 'static {
        let (node, tasks) = (self.clone(), tasks.clone());
        async move {
            let mut call = Watched::new(node.clone(), tasks, call, on_late);
            tokio::select! {
                biased;
                result = &mut call => Ok(result),
                _ = tokio::time::sleep_until(until) => Err(late),
                _ = node.silence() => {
                    node.unresponsive();
                    Err(StoreError::Unresponsive(node.unresponsive_after))
                }
            }
        }
    }
}

/// How long after a server took a new connection (having closed ours), or after a Cluster master's own
/// connections were first made, calls wait for the client's connection instead of finding none up: a
/// reconnection waits 50 to 150 ms, then connects.
const RECONNECTING_MS: u64 = 2_000;

/// Where a lost connection's server is asked whether it still accepts connections.
#[derive(Debug, Clone)]
pub enum Probe {
    Tcp(String, u16),
    Unix(std::path::PathBuf),
}

impl Probe {
    /// Opens a connection and closes it again, sending nothing.
    async fn connect(&self) -> std::io::Result<()> {
        match self {
            Probe::Tcp(host, port) => tokio::net::TcpStream::connect((host.as_str(), *port))
                .await
                .map(drop),
            #[cfg(unix)]
            Probe::Unix(path) => tokio::net::UnixStream::connect(path).await.map(drop),
            #[cfg(not(unix))]
            Probe::Unix(_) => Ok(()),
        }
    }
}

/// Whether a Cluster master refuses every key, the Cluster being down (not one slot that no master
/// serves).
pub(super) fn is_cluster_down(err: &Error) -> bool {
    let details = err.details();
    details.starts_with("CLUSTERDOWN") && !details.contains("slot not served")
}

/// What the Cluster client answers a command written as many times as it may (three, see
/// `build_pool`), each time on a connection that closed before the answer came.
const LOST_WITH_ITS_CONNECTION: &str = "Too many failed write attempts.";

/// Whether the client answered a command it never wrote: queued before it saw its connection close, it
/// found none. Sending it again is safe; connections that write a command once (see `build_pool`) do
/// not.
pub(super) fn never_written(err: &Error) -> bool {
    err.details() == "Failed to route command."
}

/// Whether a client error is the server's own error reply (it answered) rather than the connection's.
/// A Cluster master that refuses a key because its slot is moving or has moved (MOVED, ASK) answers
/// too; one that refuses every key (CLUSTERDOWN) does not serve, and the client's own routing failures
/// share their kind.
fn is_answer(err: &Error) -> bool {
    match err.kind() {
        // The client's own, about its connections.
        ErrorKind::Unknown if err.details() == LOST_WITH_ITS_CONNECTION || never_written(err) => {
            false
        }
        ErrorKind::Unknown
        | ErrorKind::InvalidArgument
        | ErrorKind::InvalidCommand
        | ErrorKind::Auth
        | ErrorKind::NotFound
        | ErrorKind::Parse => true,
        ErrorKind::Cluster => {
            err.details().starts_with("MOVED ") || err.details().starts_with("ASK ")
        }
        // The client's, after MOVED back and forth while a slot's owner is being set: answers.
        ErrorKind::Routing => err.details().starts_with("Too many redirections"),
        _ => false,
    }
}

pub type BoxedCall<R> = Pin<Box<dyn Future<Output = Result<R, Error>> + Send>>;

/// What to do with the answer to a call once it comes, when nobody waits for it any more.
pub type LateAnswer<R> = Box<dyn FnOnce(&Result<R, Error>) + Send>;

/// A command in flight, watched until it ends. Dropped before its end (the caller's answer was due, or
/// the caller went away), it keeps being watched by a background task, which hands its answer to
/// `on_late`.
pub struct Watched<R: Send + 'static> {
    node: Arc<Node>,
    tasks: TaskTracker,
    call: Option<BoxedCall<R>>,
    on_late: Option<LateAnswer<R>>,
}

impl<R: Send + 'static> Watched<R> {
    fn new(
        node: Arc<Node>,
        tasks: TaskTracker,
        call: BoxedCall<R>,
        on_late: Option<LateAnswer<R>>,
    ) -> Self {
        node.started();
        Self {
            node,
            tasks,
            call: Some(call),
            on_late,
        }
    }
}

impl<R: Send + 'static> Future for Watched<R> {
    type Output = Result<R, Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(call) = self.call.as_mut() else {
            return Poll::Pending;
        };
        match call.as_mut().poll(cx) {
            Poll::Ready(result) => {
                self.call = None;
                self.node.ended(&result);
                Poll::Ready(result)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<R: Send + 'static> Drop for Watched<R> {
    fn drop(&mut self) {
        let Some(mut call) = self.call.take() else {
            return;
        };
        let node = self.node.clone();
        if tokio::runtime::Handle::try_current().is_err() || self.tasks.is_closed() {
            // Shutting down: the connections are closing; nothing left to learn.
            node.outstanding.fetch_sub(1, Ordering::Relaxed);
            return;
        }
        let on_late = self.on_late.take();
        self.tasks.spawn(async move {
            let result = tokio::select! {
                biased;
                result = &mut call => result,
                _ = node.silence() => {
                    node.unresponsive();
                    // Still waiting: a late answer closes the breaker at once.
                    call.await
                }
            };
            node.ended(&result);
            if let Some(on_late) = on_late {
                on_late(&result);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> Arc<Node> {
        Arc::new(Node::new(
            "test:6379".into(),
            Breaker::new(5, Duration::from_millis(500)),
            Duration::from_millis(250),
            None,
        ))
    }

    async fn answer_after(ms: u64) -> Result<u32, Error> {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok(7)
    }

    fn never() -> impl Future<Output = Result<u32, Error>> + Send + 'static {
        std::future::pending()
    }

    fn late() -> StoreError {
        StoreError::Deadline(Duration::ZERO)
    }

    #[tokio::test(start_paused = true)]
    async fn answers_queued_behind_a_burst_are_waited_for_until_the_deadline() {
        let (node, tasks) = (node(), TaskTracker::new());
        let until = Instant::now() + Duration::from_secs(2);
        // A slow answer, while other answers keep arriving every 100 ms: never unresponsive.
        let others = {
            let node = node.clone();
            tokio::spawn(async move {
                for _ in 0..12 {
                    node.started();
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    node.ended::<()>(&Ok(()));
                }
            })
        };
        let got = node
            .wait(&tasks, answer_after(1_000), until, late())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, 7);
        assert!(!node.breaker.is_open());
        others.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_server_opens_the_breaker_after_the_unresponsive_time() {
        let (node, tasks) = (node(), TaskTracker::new());
        let started = Instant::now();
        let err = node
            .wait(&tasks, never(), started + Duration::from_secs(5), late())
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Unresponsive(_)), "{err}");
        assert_eq!(started.elapsed(), Duration::from_millis(250));
        assert!(node.breaker.is_open() && !node.breaker.allow());
    }

    #[tokio::test(start_paused = true)]
    async fn callers_with_short_deadlines_still_reveal_a_hung_server() {
        let (node, tasks) = (node(), TaskTracker::new());
        // Every caller gives up after 16 ms; their commands are still watched in the background.
        for _ in 0..5 {
            let until = Instant::now() + Duration::from_millis(16);
            let err = node.wait(&tasks, never(), until, late()).await.unwrap_err();
            assert!(matches!(err, StoreError::Deadline(_)));
        }
        assert!(!node.breaker.is_open());
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            node.breaker.is_open(),
            "the background watch found the silence"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_answer_to_a_given_up_command_closes_the_breaker() {
        let (node, tasks) = (node(), TaskTracker::new());
        let until = Instant::now() + Duration::from_millis(16);
        let err = node
            .wait(&tasks, answer_after(600), until, late())
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Deadline(_)));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(node.breaker.is_open());
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(!node.breaker.is_open(), "answered at 600 ms: alive again");
        assert_eq!(node.outstanding.load(Ordering::Relaxed), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn error_replies_are_answers_and_connection_errors_are_failures() {
        let node = node();
        for _ in 0..10 {
            node.started();
            node.ended::<()>(&Err(Error::new(
                ErrorKind::Unknown,
                "ERR Error running script: value is not an integer",
            )));
        }
        assert!(
            !node.breaker.is_open(),
            "a script error is not a dead server"
        );
        for reply in ["MOVED 3999 127.0.0.1:7001", "ASK 3999 127.0.0.1:7001"] {
            for _ in 0..5 {
                node.started();
                node.ended::<()>(&Err(Error::new(ErrorKind::Cluster, reply)));
            }
        }
        for _ in 0..5 {
            node.started();
            let back_and_forth = Error::new(ErrorKind::Routing, "Too many redirections.");
            node.ended::<()>(&Err(back_and_forth));
        }
        assert!(
            !node.breaker.is_open(),
            "a master refusing keys while slots move is not a dead server"
        );
        for (kind, failure) in [
            (ErrorKind::Cluster, "Failed connecting to any cluster node."),
            (ErrorKind::Unknown, "Failed to route command."),
        ] {
            for _ in 0..2 {
                node.started();
                node.ended::<()>(&Err(Error::new(kind.clone(), failure)));
            }
        }
        assert!(!node.breaker.is_open());
        node.started();
        node.ended::<()>(&Err(Error::new(ErrorKind::IO, "connection reset")));
        assert!(
            node.breaker.is_open(),
            "the client's routing failures and lost connections count, five in a row"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_cluster_refusing_every_key_keeps_the_breaker_open_until_a_call_is_decided() {
        let node = node();
        node.started();
        node.ended::<()>(&Err(Error::new(
            ErrorKind::Cluster,
            "CLUSTERDOWN The cluster is down",
        )));
        assert!(node.breaker.is_open(), "open at the first CLUSTERDOWN");
        // The client makes a new connection after each CLUSTERDOWN, and it takes the scripts.
        node.reconnected();
        assert!(
            node.breaker.is_open(),
            "a new connection is not a decided call"
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(node.breaker.allow(), "a probe");
        node.started();
        node.ended::<()>(&Err(Error::new(
            ErrorKind::Cluster,
            "CLUSTERDOWN The cluster is down",
        )));
        assert!(node.breaker.is_open());
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(node.breaker.allow());
        node.started();
        node.ended::<u32>(&Ok(1));
        assert!(!node.breaker.is_open(), "decided: serving again");
        node.reconnected();
        assert!(!node.breaker.is_open());
        // One slot no master serves is not the Cluster down.
        assert!(!is_cluster_down(&Error::new(
            ErrorKind::Cluster,
            "CLUSTERDOWN Hash slot not served"
        )));
    }
}
