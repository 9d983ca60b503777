//! Durations as settings spell them: `250ms`, `10s`, `1m 30s` (humantime), in settings files and
//! `RATELIMITD_*` variables. Used as `#[serde(with = "crate::duration")]` by the option types of every
//! layer; the reference service's variables, which follow Go's syntax, are read in `settings`.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serializer};

pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&humantime::format_duration(*d).to_string())
}

/// The longest duration a setting may hold: longer than any timeout, period or lease needs, and far
/// from what adding it to the clock could overflow.
pub const LONGEST: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    let duration = humantime::parse_duration(&text).map_err(|e| {
        serde::de::Error::custom(format!(
            "invalid duration {text:?} ({e}); write e.g. 250ms, 10s, 1m"
        ))
    })?;
    at_most_longest(duration).map_err(serde::de::Error::custom)
}

/// `duration`, unless it is longer than [`LONGEST`].
pub fn at_most_longest(duration: Duration) -> Result<Duration, String> {
    if duration > LONGEST {
        return Err(format!(
            "duration {} is longer than 100 years: a duration setting holds at most 100 years",
            humantime::format_duration(duration)
        ));
    }
    Ok(duration)
}
