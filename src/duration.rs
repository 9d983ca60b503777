//! Durations as settings spell them: `250ms`, `10s`, `1m 30s` (humantime), in settings files and
//! `RATELIMITD_*` variables. Used as `#[serde(with = "crate::duration")]` by the option types of every
//! layer; the reference service's variables, which follow Go's syntax, are read in `settings`.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serializer};

pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&humantime::format_duration(*d).to_string())
}

pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    humantime::parse_duration(&text).map_err(|e| {
        serde::de::Error::custom(format!(
            "invalid duration {text:?} ({e}); write e.g. 250ms, 10s, 1m"
        ))
    })
}
