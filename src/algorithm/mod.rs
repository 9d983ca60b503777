//! Rate limit algorithms as pure arithmetic: state, time and cost in; verdict and new state out.
//! No I/O, no clock, no async: the stores run them (the memory store directly, the Redis scripts by
//! mirroring them), and the same scenarios check every implementation.

pub mod fixed_window;
