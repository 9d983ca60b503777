//! Coalescing: the requests that reach a Redis server while its calls are in flight travel together in
//! its next script call.
//!
//! Each server has a [`Lane`]: the parts waiting for it, and how many calls it has in flight (at most
//! `redis.calls_in_flight`). A part that finds a call free is sent at once, in a call of its own; the
//! parts that arrive while every call is busy wait in the lane, and the first call to end takes them,
//! in arrival order, bounded by `redis.batch_max_requests` and `redis.batch_max_bytes`. There is no
//! timer: an idle service sends every request at once, a busy one sends fewer, larger calls, and the
//! script still decides each request on its own, all-or-nothing, in that order.
//!
//! A caller waits for its own part until its own answer is due; a part whose caller stopped waiting
//! before its call was sent is dropped, never counted. The call itself is watched by the server's
//! [`Node`], which tells a slow answer from a silent server.
//!
//! On Cluster a request's checks on one server are one part, whatever their slots, and a call carries
//! the parts of every slot of that server: the keys of the first slot are declared (Redis routes by
//! them) and the script reads the others itself. While slots move, such a call may be refused before it
//! writes anything; its parts are then sent one per call, and a part that spans slots and is refused
//! again is answered [`StoreError::SlotsMoved`], on which its request goes again one slot per call.
//! A call of one slot follows the slot ([`Caller::follow`]): through the Cluster client once the slot
//! has moved, to the importing master right after ASKING while its keys are already there, and again a
//! moment later while they are on both sides.

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use fred::{
    cmd,
    error::{Error, ErrorKind},
    prelude::*,
    types::{config::Server, scripts::Script, Key},
};
use futures_util::future::join_all;
use tokio::{sync::oneshot, time::Instant};
use tokio_util::task::TaskTracker;

use super::{
    backend::Masters,
    node::{never_written, BoxedCall, LateAnswer, Node},
    redis_error,
    script::{unpack_reply, DecideCall, Part, PartReply, Return},
};
use crate::store::StoreError;

/// How large one call may grow.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Parts (requests, or their share on one server) per call.
    pub requests: usize,
    /// About the bytes of keys and arguments per call.
    pub bytes: usize,
    /// Calls in flight per server.
    pub calls: usize,
}

/// One part waiting for a call.
struct Waiting {
    part: Part,
    /// The part's caller stops waiting then.
    until: Instant,
    answer: oneshot::Sender<Answered>,
}

/// A part's answer, and the part itself: handed back so that its memory, and its answer's, is freed by
/// the caller that allocated it. A block freed on another thread than its own costs more, there and
/// when its thread next allocates.
struct Answered {
    part: Part,
    reply: Result<PartReply, StoreError>,
}

impl Waiting {
    /// Hands the part its answer, which carries the hits it was granted in leases until a lease holds
    /// them: an answer its caller never reads (it stopped waiting, or went away) gives them back.
    fn answer(self, caller: &Arc<Caller>, node: &Arc<Node>, reply: Result<PartReply, StoreError>) {
        let reply = reply.map(|mut reply| {
            reply.unheld = Unheld::of(caller, node, &self.part, &reply);
            reply
        });
        let answered = Answered {
            part: self.part,
            reply,
        };
        // Refused when its caller is gone: dropped, the answer gives its grants back.
        let _ = self.answer.send(answered);
    }
}

/// The hits `reply` leased to checks of `part`, as returns, each with its check's place in the part.
fn unheld<'a>(part: &'a Part, reply: &'a PartReply) -> impl Iterator<Item = (usize, Return)> + 'a {
    reply
        .grants
        .iter()
        .filter(|grant| grant.hits > 0)
        .filter_map(|grant| {
            let check = part.checks.get(grant.check)?;
            let give_back = Return {
                key: check.key.clone(),
                slot: check.slot,
                spec: check.spec,
                hits: grant.hits,
                granted_ms: grant.server_ms,
            };
            Some((grant.check, give_back))
        })
}

/// Hits a part was leased that no lease of this replica holds yet. Carried by the part's reply from
/// the moment the call is answered, and given back when dropped: a reply its caller never reads, or
/// one its request drops (another server of the request failed, the request went away), leaves no
/// hits counted for no replica. The request takes out those a lease came to hold ([`Unheld::held`]).
pub struct Unheld {
    caller: Arc<Caller>,
    node: Arc<Node>,
    /// By the check's place in its part.
    returns: Vec<(usize, Return)>,
}

impl Unheld {
    /// What `reply` leased to `part`'s checks, if anything.
    fn of(
        caller: &Arc<Caller>,
        node: &Arc<Node>,
        part: &Part,
        reply: &PartReply,
    ) -> Option<Box<Self>> {
        let returns: Vec<(usize, Return)> = unheld(part, reply).collect();
        (!returns.is_empty()).then(|| {
            Box::new(Self {
                caller: caller.clone(),
                node: node.clone(),
                returns,
            })
        })
    }

    /// A lease holds now what was granted to the check at `check` in the part.
    pub fn held(&mut self, check: usize) {
        self.returns.retain(|(c, _)| *c != check);
    }
}

impl Drop for Unheld {
    fn drop(&mut self) {
        let returns = self.returns.drain(..).map(|(_, r)| r).collect();
        self.caller.give_back_unheld(&self.node, returns);
    }
}

impl std::fmt::Debug for Unheld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unheld")
            .field("server", &self.node.name())
            .field("returns", &self.returns)
            .finish()
    }
}

/// The parts waiting for one server, and its calls in flight.
#[derive(Default)]
pub struct Lane {
    queue: Mutex<Queue>,
}

#[derive(Default)]
struct Queue {
    waiting: VecDeque<Waiting>,
    calls: usize,
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let queue = self.lock();
        f.debug_struct("Lane")
            .field("waiting", &queue.waiting.len())
            .field("calls", &queue.calls)
            .finish()
    }
}

impl Lane {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a part; true when a call was free, which the caller must then start.
    fn push(&self, waiting: Waiting, bounds: Bounds) -> bool {
        let mut queue = self.lock();
        queue.waiting.push_back(waiting);
        let free = queue.calls < bounds.calls;
        if free {
            queue.calls += 1;
        }
        free
    }

    /// The next call's parts, oldest first, within the bounds; those whose callers stopped waiting are
    /// dropped. `None` (and one call fewer in flight) when nothing waits.
    fn take(&self, bounds: Bounds) -> Option<Vec<Waiting>> {
        let mut queue = self.lock();
        let mut batch = Vec::new();
        let mut bytes = 0;
        while batch.len() < bounds.requests {
            let Some(next) = queue.waiting.front() else {
                break;
            };
            if next.answer.is_closed() {
                queue.waiting.pop_front();
                continue;
            }
            let size = next.part.wire_bytes();
            if !batch.is_empty() && bytes + size > bounds.bytes {
                break;
            }
            bytes += size;
            batch.extend(queue.waiting.pop_front());
        }
        if batch.is_empty() {
            queue.calls -= 1;
            return None;
        }
        Some(batch)
    }
}

/// What every call to one Redis deployment needs.
pub struct Caller {
    pub pool: Pool,
    /// The Cluster's masters, for the keys a slot's migration has moved already.
    pub masters: Masters,
    pub script: Script,
    pub cluster: bool,
    /// Most extra seconds of TTL for new fixed-window counters (`EXPIRATION_JITTER_MAX_SECONDS`).
    pub jitter_max: u64,
    pub bounds: Bounds,
    /// Calls whose callers stopped waiting, and the lanes' own tasks, watched until they end.
    pub tasks: TaskTracker,
    /// How long leased hits nobody holds are given back for (`REDIS_TIMEOUT`).
    pub give_back_within: Duration,
}

impl Caller {
    /// Decides `part` on `node`, in a call of its own or with the parts waiting beside it; waits until
    /// `until`, then answers `late`.
    pub async fn decide(
        self: &Arc<Self>,
        node: &Arc<Node>,
        part: Part,
        until: Instant,
        late: StoreError,
    ) -> Result<PartReply, StoreError> {
        let (answer, answered) = oneshot::channel();
        let waiting = Waiting {
            part,
            until,
            answer,
        };
        if node.lane.push(waiting, self.bounds) {
            self.tasks.spawn(self.clone().serve(node.clone()));
        }
        tokio::select! {
            biased;
            answer = answered => match answer {
                Ok(Answered { part, reply }) => {
                    drop(part);
                    reply
                }
                Err(_) => Err(StoreError::Backend(
                    "the Redis call carrying this request was dropped".into(),
                )),
            },
            // An answer sent as the wait ended goes with the receiver, and gives its leases back.
            _ = tokio::time::sleep_until(until) => Err(late),
        }
    }

    /// One of the server's calls in flight: sends what waits, until nothing does.
    async fn serve(self: Arc<Self>, node: Arc<Node>) {
        while let Some(batch) = node.lane.take(self.bounds) {
            self.send(&node, batch).await;
        }
    }

    /// Sends one call and hands every part its answer. Every part passed the server's breaker when
    /// its request was admitted, moments ago.
    async fn send(self: &Arc<Self>, node: &Arc<Node>, mut batch: Vec<Waiting>) {
        let until = batch
            .iter()
            .map(|w| w.until)
            .max()
            .unwrap_or_else(Instant::now);
        let parts: Vec<&Part> = batch.iter().map(|w| &w.part).collect();
        let result = self.call(node, &parts, &[], until, Route::Node).await;
        drop(parts);
        let reply = match result {
            Err(CallError::Moved(err)) => {
                // Slots are moving: one request per call, each in a task of its own, so that one
                // waiting for its slot's migration holds up neither the others nor this lane.
                tracing::debug!(server = %node.name(), parts = batch.len(), "a call was refused ({err}); sending one request per call");
                for waiting in batch {
                    let (caller, node) = (self.clone(), node.clone());
                    self.tasks
                        .spawn(async move { caller.alone(&node, waiting).await });
                }
                return;
            }
            other => other.map_err(StoreError::from).and_then(|reply| {
                let mut parts: Vec<&mut Part> = batch.iter_mut().map(|w| &mut w.part).collect();
                PartReply::parse_all(&reply, &mut parts)
            }),
        };
        match reply {
            Ok(replies) => {
                for (waiting, reply) in batch.into_iter().zip(replies) {
                    waiting.answer(self, node, Ok(reply));
                }
            }
            Err(err) => {
                for waiting in batch {
                    waiting.answer(self, node, Err(err.clone()));
                }
            }
        }
    }

    /// For a call of `parts` that asks for leases: what to do with its answer if it comes after the
    /// call stopped waiting (every caller's deadline passed, or the server seemed unresponsive): give
    /// back what it leased, which no replica will hold.
    fn unheld_when_late(
        self: &Arc<Self>,
        node: &Arc<Node>,
        parts: &[&Part],
    ) -> Option<LateAnswer<Bytes>> {
        if !parts.iter().any(|part| part.asks_lease()) {
            return None;
        }
        let mut parts: Vec<Part> = parts.iter().map(|&part| part.clone()).collect();
        let (caller, node) = (self.clone(), node.clone());
        Some(Box::new(move |answer: &Result<Bytes, Error>| {
            let Ok(bytes) = answer else {
                return;
            };
            let mut each: Vec<&mut Part> = parts.iter_mut().collect();
            let replies =
                unpack_reply(bytes).and_then(|ints| PartReply::parse_all(&ints, &mut each));
            let Ok(replies) = replies else {
                return;
            };
            let returns = parts.iter().zip(&replies).flat_map(|(p, r)| unheld(p, r));
            caller.give_back_unheld(&node, returns.map(|(_, r)| r).collect());
        }))
    }

    /// Gives back, in a task of its own, hits leases granted that no replica holds (their callers had
    /// stopped waiting, or their requests failed or went away): they would weigh on the counter until
    /// its window ends.
    fn give_back_unheld(self: &Arc<Self>, node: &Arc<Node>, returns: Vec<Return>) {
        // Outside the runtime (it is shutting down) there is nothing left to send them with.
        if returns.is_empty() || tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let (caller, node) = (self.clone(), node.clone());
        self.tasks.spawn(async move {
            let until = Instant::now() + caller.give_back_within;
            if let Err(err) = caller.give_back(&node, &returns, until).await {
                tracing::warn!(server = %node.name(), "leased hits no replica holds (their request stopped waiting, failed or went away) not given back: {err}");
            }
        });
    }

    /// Decides a part of a call its server refused as moved, in a call of its own, and answers it. One
    /// of a single slot follows the slot; one of several that is refused again goes back to its
    /// request, to go one slot per call.
    async fn alone(self: &Arc<Self>, node: &Arc<Node>, mut waiting: Waiting) {
        let until = waiting.until;
        if waiting.answer.is_closed() || Instant::now() >= until {
            // Its caller has stopped waiting: nothing is sent, nothing counted.
            waiting.answer(self, node, Err(StoreError::Deadline(Duration::ZERO)));
            return;
        }
        let reply = async {
            let parts = [&waiting.part];
            let reply = if spans_slots(&waiting.part) {
                match self.call(node, &parts, &[], until, Route::Node).await {
                    Err(CallError::Moved(_)) => return Err(StoreError::SlotsMoved),
                    reply => reply?,
                }
            } else {
                let gone = || waiting.answer.is_closed();
                self.follow(node, &parts, &[], until, &gone).await?
            };
            let mut replies = PartReply::parse_all(&reply, &mut [&mut waiting.part])?;
            replies
                .pop()
                .ok_or_else(|| StoreError::Backend("decide.lua answered no part".into()))
        }
        .await;
        waiting.answer(self, node, reply);
    }

    /// Gives leased hits back to `node`'s keys, in a call of their own; waits until `until`.
    pub async fn give_back(
        self: &Arc<Self>,
        node: &Arc<Node>,
        returns: &[Return],
        until: Instant,
    ) -> Result<(), StoreError> {
        match self.call(node, &[], returns, until, Route::Node).await {
            // Slots moving: one call per slot, each following its slot (the slots of one master may
            // have gone to different ones).
            Err(CallError::Moved(_)) => {
                let mut slots: Vec<u16> = returns.iter().map(|r| r.slot).collect();
                slots.sort_unstable();
                slots.dedup();
                // Together: a slot that waits for its migration does not keep the others' returns.
                let calls = slots.into_iter().map(|slot| async move {
                    let of_slot: Vec<Return> =
                        returns.iter().filter(|r| r.slot == slot).cloned().collect();
                    let reply = self.follow(node, &[], &of_slot, until, &|| false).await?;
                    PartReply::parse_all(&reply, &mut []).map(drop)
                });
                join_all(calls).await.into_iter().collect()
            }
            reply => {
                PartReply::parse_all(&reply?, &mut [])?;
                Ok(())
            }
        }
    }

    /// Sends again a call of one slot that `node` refused as moved, until it is decided, `until`, or
    /// its caller is `gone`: through the Cluster client once the slot is another master's (it learns
    /// the new slot map on the way), to the importing master right after ASKING while the keys are
    /// already there, and again a moment later while they are on both sides. Nothing was written by a
    /// refused call.
    async fn follow(
        self: &Arc<Self>,
        node: &Arc<Node>,
        parts: &[&Part],
        returns: &[Return],
        until: Instant,
        gone: &(dyn Fn() -> bool + Sync),
    ) -> Result<Vec<i64>, CallError> {
        let (mut to, mut route, mut pauses) = (node.clone(), Route::Node, Pauses::default());
        loop {
            let err = match self.call(&to, parts, returns, until, route).await {
                Err(CallError::Moved(err)) => err,
                decided => return decided,
            };
            (to, route) = match Next::after(&err, route, &self.masters) {
                Next::Cluster => (node.clone(), Route::Cluster),
                Next::Asking(master) => (master, Route::Asking),
                Next::Pause => {
                    tokio::time::sleep_until((Instant::now() + pauses.next()).min(until)).await;
                    (node.clone(), Route::Node)
                }
            };
            if Instant::now() >= until || gone() {
                return Err(CallError::Moved(err));
            }
        }
    }

    /// One EVALSHA of `parts` (after giving back `returns`), loading the script again when the server
    /// lost it; its reply's integers.
    async fn call(
        self: &Arc<Self>,
        node: &Arc<Node>,
        parts: &[&Part],
        returns: &[Return],
        until: Instant,
        route: Route,
    ) -> Result<Vec<i64>, CallError> {
        let jitter = if self.jitter_max == 0 {
            0
        } else {
            rand::random_range(0..=self.jitter_max)
        };
        let pool = match (route, node.direct()) {
            (Route::Node | Route::Asking, Some(own)) => own,
            (Route::Asking, None) => return Err(CallError::Moved(importing_closed())),
            _ => &self.pool,
        };
        let mut client = pool.next_connected().clone();
        let (mut loaded, mut unsent) = (false, false);
        loop {
            // The command is made and handed to `wait` (which boxes it) in a block of its own: a
            // local still in scope at the await would keep its room in this future, and in the
            // lane's task that awaits it.
            let waiting = {
                let DecideCall { keys, args } =
                    DecideCall::new(parts, returns, jitter, self.cluster);
                let (sha, sender) = (self.script.sha1().clone(), client.clone());
                let call: BoxedCall<Bytes> = if route == Route::Asking {
                    Box::pin(asking(sender, sha, keys, args))
                } else {
                    Box::pin(async move { sender.evalsha(sha, keys, args).await })
                };
                let late = StoreError::Deadline(until.saturating_duration_since(Instant::now()));
                let on_late = self.unheld_when_late(node, parts);
                node.wait_boxed(&self.tasks, call, until, late, on_late)
            };
            match waiting.await? {
                Ok(reply) => return Ok(unpack_reply(&reply)?),
                Err(err) if !loaded && err.details().starts_with("NOSCRIPT") => {
                    // Boxed: rare, and the client's future is large (see the block above).
                    Box::pin(self.script.load(&client))
                        .await
                        .map_err(redis_error)?;
                    loaded = true;
                }
                // Queued before the client saw its connection close, never written: sent again,
                // once, after the reconnection it queued since.
                Err(err) if !unsent && never_written(&err) && Instant::now() < until => {
                    client = pool.next_connected().clone();
                    unsent = true;
                }
                Err(err) if self.cluster && is_moved(&err) => return Err(CallError::Moved(err)),
                Err(err) => return Err(redis_error(err).into()),
            }
        }
    }
}

/// Which connections a call goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Route {
    /// Its server's own, on a Cluster master that has them; else the deployment's.
    Node,
    /// The Cluster client's, which follow redirections.
    Cluster,
    /// A master's own, right after ASKING: it is importing the call's slot, and has its keys.
    Asking,
}

/// Where a call of one slot goes after its master refused it as moved.
pub(super) enum Next {
    /// Through the Cluster client: the slot is another master's (the client reads the new slot map
    /// on the way).
    Cluster,
    /// To this master, which is importing the slot, right after ASKING: the keys are there already.
    Asking(Arc<Node>),
    /// Again to its own master after a pause: the keys are on both sides, the master asked for has
    /// no connections of its own here, or the call went that way already.
    Pause,
}

impl Next {
    /// Where a call that went by `route` goes after the refusal `err`.
    pub(super) fn after(err: &Error, route: Route, masters: &Masters) -> Self {
        match Refused::of(err) {
            Refused::Asked(server) if route != Route::Asking => {
                masters.importing(&server).map_or(Self::Pause, Self::Asking)
            }
            Refused::Moved if route != Route::Cluster => Self::Cluster,
            _ => Self::Pause,
        }
    }
}

/// What a Cluster master's refusal of a call of one slot says about where its keys are.
#[derive(Debug, PartialEq, Eq)]
enum Refused {
    /// The slot is another master's now (MOVED), or the refusal names none.
    Moved,
    /// The slot is moving to `Server`, and the keys are there already (ASK).
    Asked(Server),
    /// The slot is moving and its keys are on both sides (TRYAGAIN), or the refusal names a master
    /// this replica has no connections to yet: the keys are on one side a moment later.
    Wait,
}

impl Refused {
    fn of(err: &Error) -> Self {
        let details = err.details();
        if details.starts_with("TRYAGAIN") {
            return Self::Wait;
        }
        // ASK <slot> <host>:<port>
        let Some(rest) = details.strip_prefix("ASK ") else {
            return Self::Moved;
        };
        let address = rest.split_whitespace().nth(1).unwrap_or("");
        match address.rsplit_once(':').map(|(h, p)| (h, p.parse::<u16>())) {
            Some((host, Ok(port))) if !host.is_empty() => Self::Asked(Server::new(host, port)),
            _ => Self::Wait,
        }
    }
}

/// The pauses before a call of a migrating slot goes again: 2 ms, doubled each time up to 32 ms.
pub(super) struct Pauses(Duration);

impl Default for Pauses {
    fn default() -> Self {
        Self(Duration::from_millis(2))
    }
}

impl Pauses {
    /// The next pause.
    pub(super) fn next(&mut self) -> Duration {
        let pause = self.0;
        self.0 = (pause * 2).min(Duration::from_millis(32));
        pause
    }
}

/// Why a call for a master importing a slot was not sent: its own connections were closed meanwhile
/// (it is no longer a master). Read as TRYAGAIN: asked again after a pause, by slot map.
pub(super) fn importing_closed() -> Error {
    let why = "TRYAGAIN the importing master's connections are closed";
    Error::new(ErrorKind::Cluster, why)
}

/// EVALSHA right after ASKING, both on one connection of the master `client` reaches: how keys that a
/// slot's migration has moved there already are reached before the slot is that master's. The Cluster
/// client's own following of ASK sends the command itself back to the slot's old owner, which answers
/// ASK again until the client gives up.
pub(super) async fn asking<R: FromValue>(
    client: Client,
    sha: fred::bytes_utils::Str,
    keys: Vec<Key>,
    args: Vec<Value>,
) -> Result<R, Error> {
    let pipeline = client.pipeline();
    let () = pipeline.custom(cmd!("ASKING"), Vec::<Value>::new()).await?;
    let count = Value::from(i64::try_from(keys.len()).unwrap_or(i64::MAX));
    let command: Vec<Value> = [Value::from(sha), count]
        .into_iter()
        .chain(keys.into_iter().map(Value::from))
        .chain(args)
        .collect();
    let () = pipeline.custom(cmd!("EVALSHA"), command).await?;
    pipeline.last().await
}

/// Why a call failed.
enum CallError {
    /// A Cluster call reached keys its server no longer serves (slots moving); nothing was written.
    Moved(Error),
    Store(StoreError),
}

impl From<StoreError> for CallError {
    fn from(err: StoreError) -> Self {
        Self::Store(err)
    }
}

impl From<CallError> for StoreError {
    fn from(err: CallError) -> Self {
        match err {
            CallError::Moved(err) => redis_error(err),
            CallError::Store(err) => err,
        }
    }
}

/// Whether a part's checks are in more than one Cluster slot.
fn spans_slots(part: &Part) -> bool {
    part.checks.windows(2).any(|w| w[0].slot != w[1].slot)
}

/// Whether a Cluster error says a key of the call is not (or not only) on the server that ran it.
pub(super) fn is_moved(err: &Error) -> bool {
    let details = err.details();
    [
        "non local key",
        "CROSSSLOT",
        "TRYAGAIN",
        "MOVED",
        "ASK",
        "hash to the same slot",
        // The Cluster client's, after MOVED back and forth while an owner is being set.
        "Too many redirections",
    ]
    .iter()
    .any(|sign| details.contains(sign))
}

#[cfg(test)]
mod tests {
    use fred::{
        error::{Error, ErrorKind},
        types::config::Server,
    };

    use super::{Pauses, Refused};

    fn refused(kind: ErrorKind, reply: &str) -> Refused {
        Refused::of(&Error::new(kind, reply.to_owned()))
    }

    #[test]
    fn a_refusal_says_where_the_keys_of_a_moving_slot_are() {
        assert_eq!(
            refused(ErrorKind::Cluster, "ASK 3999 127.0.0.1:7002"),
            Refused::Asked(Server::new("127.0.0.1", 7002))
        );
        assert_eq!(
            refused(ErrorKind::Cluster, "ASK 3999 redis-2.redis.svc:6379"),
            Refused::Asked(Server::new("redis-2.redis.svc", 6379))
        );
        assert_eq!(
            refused(ErrorKind::Cluster, "MOVED 3999 127.0.0.1:7002"),
            Refused::Moved
        );
        let both_sides = "TRYAGAIN Multiple keys request during rehashing of slot";
        assert_eq!(refused(ErrorKind::Unknown, both_sides), Refused::Wait);
        // A refusal naming no master it can be asked at: a moment later, by slot map.
        assert_eq!(refused(ErrorKind::Cluster, "ASK 3999 :7002"), Refused::Wait);
        assert_eq!(refused(ErrorKind::Cluster, "ASK 3999"), Refused::Wait);
        let script = "ERR Script attempted to access a non local key in a cluster node script";
        assert_eq!(refused(ErrorKind::Unknown, script), Refused::Moved);
    }

    #[test]
    fn a_migrating_slot_is_asked_again_2_to_32_ms_apart() {
        let mut pauses = Pauses::default();
        let ms: Vec<u128> = (0..7).map(|_| pauses.next().as_millis()).collect();
        assert_eq!(ms, [2, 4, 8, 16, 32, 32, 32]);
    }
}
