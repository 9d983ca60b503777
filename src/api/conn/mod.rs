//! Accepting connections, on both listeners, with a bound on how many are open at once, and the
//! bounds each connection carries through its life.
//!
//! - **Places.** Past the listener's `max_connections` the accept loop waits for a connection to close:
//!   new clients wait in the kernel's backlog instead of costing memory or a file descriptor here. An
//!   accept that fails (out of file descriptors: EMFILE, ENFILE) pauses the loop briefly and is tried
//!   again; it never ends the loop or the listener.
//! - **Handshake** (gRPC). A connection must finish its TLS handshake and send the HTTP/2 client
//!   preface (24 bytes of magic and a SETTINGS frame) within `grpc.handshake_timeout` of its accept, or
//!   its reads and writes fail and the server drops it: silent connections cannot keep the places.
//! - **Idle** (gRPC). A connection on which no call has been in flight for `grpc.idle_timeout` is closed
//!   the same way (grpc-go's MaxConnectionIdle). Calls are counted by [`TrackCallsLayer`], which finds
//!   the connection's [`Activity`] in each request's extensions (tonic puts the connection's
//!   [`ConnectionInfo`] there). With no call in flight, closing loses nothing; the client reconnects on
//!   its next call. The close is not an HTTP/2 GOAWAY (tonic offers no per-connection graceful close),
//!   so a call the client sends at that very moment fails as on any lost connection. Bytes alone cannot
//!   tell idleness: HTTP/2 keep-alive PINGs flow on idle connections.
//! - **Stall** (HTTP). A connection that moves no byte either way for `http.idle_timeout` is closed: a
//!   stalled upload, a client that stops reading its answer.
//! - **Messages** (gRPC). A request's messages reach tonic only once each has arrived in full, and a
//!   request must arrive within `grpc.message_timeout` ([`WholeMessagesLayer`]): a call that declares a
//!   large message and sends nothing more holds neither memory nor its connection.
//! - **Cut-off** (gRPC age). Connections are recycled by age (`grpc.max_connection_age`): tonic closes
//!   them gracefully at the age (HTTP/2 GOAWAY), and each connection is cut at the age plus the grace,
//!   whatever still runs on it. tonic's own `max_connection_age_grace` is not used: with it set, tonic
//!   skips the GOAWAY at the age and only closes the connection abruptly at the age plus the grace.
//!
//! - **Drain** (gRPC). Health watches and reflection sessions end with UNAVAILABLE when the listeners
//!   stop accepting ([`EndAtDrainLayer`]): open for as long as their clients like, they would otherwise
//!   hold every shutdown for the whole grace period.
//!
//! Every timer is polled from the connection's own reads and writes, so an idle connection (a read
//! pending, nothing to write) is woken and closed on time, and nothing runs beside the connection.
//!
//! # Layout
//! - `accept` — the accept loop and the places ([`Acceptor`], [`Place`]).
//! - `bounds` — the bounds from the settings ([`Bounds`], [`ConnectionAge`]) and the timers each
//!   connection arms from them; `deadline` holds the timers, `preface` follows the HTTP/2 preface.
//! - `calls` — the calls in flight on each connection ([`TrackCallsLayer`], [`Activity`]).
//! - `drain` — the streams that end when the drain begins ([`EndAtDrainLayer`]).
//! - `io` — the connection as the servers see it ([`Counted`], [`ConnectionInfo`]).
//! - `messages` — request messages whole and in time ([`WholeMessagesLayer`]).

mod accept;
mod bounds;
mod calls;
mod deadline;
mod drain;
mod io;
mod messages;
mod preface;

pub use accept::{Acceptor, Closing, Place};
pub use bounds::{Bounds, ConnectionAge};
pub use calls::{Activity, CallGuard, Guarded, TrackCalls, TrackCallsLayer, TrackedCall};
pub use drain::{EndAtDrain, EndAtDrainLayer, Ending, EndingCall};
pub use io::{ConnectionInfo, Counted};
pub use messages::{
    HeldBytes, WholeMessages, WholeMessagesLayer, WholeMessagesService, HELD_FULL, MESSAGE_TIMEOUT,
    QUOTA_STREAM, SHOULD_RATE_LIMIT,
};
