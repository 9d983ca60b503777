//! The protobuf JSON mapping of `RateLimitRequest` and `RateLimitResponse`, for `/json`.
//!
//! Requests accept both the lowerCamelCase JSON names and the proto field names, enums by name or
//! number, and 64-bit integers as numbers or strings, as protobuf JSON parsers do; unknown fields are
//! refused. Responses use lowerCamelCase, enum names, durations like `"58s"`, and omit default values.
//!
//! A request is read field by field as it is parsed, never into a generic JSON tree (which costs up to
//! a hundred times the body's size), and refused as soon as it holds more descriptors or entries than
//! `request_limits` allows: what a body can make the service allocate stays close to its own size.

use std::{borrow::Cow, fmt, marker::PhantomData};

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{json, Map, Value};

use crate::{
    limiter::{self, Code, LimitOverride, RequestLimits},
    rules::Unit,
};

/// Parses a protobuf-JSON `RateLimitRequest`.
pub fn parse_request(body: &[u8], limits: &RequestLimits) -> Result<limiter::Request, String> {
    let mut parser = serde_json::Deserializer::from_slice(body);
    let read = Nullable::<limiter::Request>::new(limits)
        .deserialize(&mut parser)
        .and_then(|request| parser.end().map(|()| request));
    match read {
        Ok(Some(request)) => Ok(request),
        Ok(None) => Err("RateLimitRequest: expected a JSON object".into()),
        Err(e) if e.classify() == serde_json::error::Category::Data => Err(e.to_string()),
        Err(e) => Err(format!("invalid JSON: {e}")),
    }
}

/// A message read from a JSON object, field by field.
trait Message: Default {
    const NAME: &'static str;

    /// Reads field `name`'s value from `map` into `self`; false when the message has no such field.
    fn field<'de, A: MapAccess<'de>>(
        &mut self,
        name: &str,
        map: &mut A,
        limits: &RequestLimits,
    ) -> Result<bool, A::Error>;
}

impl Message for limiter::Request {
    const NAME: &'static str = "RateLimitRequest";

    fn field<'de, A: MapAccess<'de>>(
        &mut self,
        name: &str,
        map: &mut A,
        limits: &RequestLimits,
    ) -> Result<bool, A::Error> {
        match name {
            "domain" => self.domain = string(map, "domain")?,
            "descriptors" => {
                self.descriptors = list(
                    map,
                    "descriptors",
                    (limits.max_descriptors, "request_limits.max_descriptors"),
                    limits,
                )?
            }
            "hitsAddend" | "hits_addend" => self.hits_addend = uint32(map, "hitsAddend")?,
            _ => return Ok(false),
        }
        Ok(true)
    }
}

impl Message for limiter::Descriptor {
    const NAME: &'static str = "RateLimitDescriptor";

    fn field<'de, A: MapAccess<'de>>(
        &mut self,
        name: &str,
        map: &mut A,
        limits: &RequestLimits,
    ) -> Result<bool, A::Error> {
        match name {
            "entries" => {
                self.entries = list(
                    map,
                    "entries",
                    (limits.max_entries, "request_limits.max_entries"),
                    limits,
                )?
            }
            "limit" => {
                self.limit = map
                    .next_value_seed(Nullable::<Override>::new(limits))?
                    .map(|o| o.0)
            }
            "hitsAddend" | "hits_addend" => {
                let hits = map.next_value_seed(Scalar("hitsAddend", "a non-negative integer"))?;
                if !matches!(hits, Token::Null) {
                    self.hits_addend = Some(hits.integer("hitsAddend")?);
                }
            }
            _ => return Ok(false),
        }
        Ok(true)
    }
}

impl Message for limiter::Entry {
    const NAME: &'static str = "Entry";

    fn field<'de, A: MapAccess<'de>>(
        &mut self,
        name: &str,
        map: &mut A,
        _: &RequestLimits,
    ) -> Result<bool, A::Error> {
        match name {
            "key" => self.key = string(map, "key")?,
            "value" => self.value = string(map, "value")?,
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// `RateLimitOverride`, which has no default of its own.
struct Override(LimitOverride);

impl Default for Override {
    fn default() -> Self {
        Self(LimitOverride {
            requests_per_unit: 0,
            unit: None,
        })
    }
}

impl Message for Override {
    const NAME: &'static str = "RateLimitOverride";

    fn field<'de, A: MapAccess<'de>>(
        &mut self,
        name: &str,
        map: &mut A,
        _: &RequestLimits,
    ) -> Result<bool, A::Error> {
        match name {
            "requestsPerUnit" | "requests_per_unit" => {
                self.0.requests_per_unit = uint32(map, "requestsPerUnit")?
            }
            "unit" => {
                self.0.unit = match map.next_value_seed(Scalar("unit", "an enum name or number"))? {
                    Token::Str(s) if s == "UNKNOWN" => None,
                    Token::Str(s) => Some(
                        Unit::from_name(&s)
                            .filter(|_| s.chars().all(|c| c.is_ascii_uppercase()))
                            .ok_or_else(|| {
                                de::Error::custom(format!(
                                    "unit: unknown enum value {:?}",
                                    quoted(&s)
                                ))
                            })?,
                    ),
                    Token::Unsigned(n) => i32::try_from(n).ok().and_then(Unit::from_wire),
                    Token::Null => None,
                    _ => return Err(de::Error::custom("unit: expected an enum name or number")),
                }
            }
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// A string field's value (`null` reads as empty).
fn string<'de, A: MapAccess<'de>>(map: &mut A, field: &'static str) -> Result<String, A::Error> {
    match map.next_value_seed(Scalar(field, "a string"))? {
        Token::Str(s) => Ok(s.into_owned()),
        Token::Null => Ok(String::new()),
        _ => Err(de::Error::custom(format!("{field}: expected a string"))),
    }
}

/// A non-negative integer field's value, as a JSON number or a decimal string (`null` reads as 0).
fn integer<'de, A: MapAccess<'de>>(map: &mut A, field: &'static str) -> Result<u64, A::Error> {
    map.next_value_seed(Scalar(field, "a non-negative integer"))?
        .integer(field)
}

/// A `uint32` field's value, as [`integer`] reads it.
fn uint32<'de, A: MapAccess<'de>>(map: &mut A, field: &'static str) -> Result<u32, A::Error> {
    u32::try_from(integer(map, field)?)
        .map_err(|_| de::Error::custom(format!("{field}: out of range for uint32")))
}

/// A repeated message field's value, refused past `most` items while it is read.
fn list<'de, A: MapAccess<'de>, M: Message>(
    map: &mut A,
    field: &'static str,
    most: (usize, &'static str),
    limits: &RequestLimits,
) -> Result<Vec<M>, A::Error> {
    map.next_value_seed(List {
        field,
        most,
        limits,
        item: PhantomData,
    })
}

/// A JSON value that is not an object or an array.
enum Token<'de> {
    Str(Cow<'de, str>),
    Unsigned(u64),
    /// A number written with a fraction or an exponent.
    Float(f64),
    Null,
    Other,
}

impl Token<'_> {
    fn integer<E: de::Error>(self, field: &str) -> Result<u64, E> {
        let wrong = || E::custom(format!("{field}: expected a non-negative integer"));
        match self {
            Token::Unsigned(n) => Ok(n),
            Token::Str(s) => s
                .parse()
                .or_else(|_| s.parse::<f64>().map_err(drop).and_then(whole))
                .map_err(|()| wrong()),
            Token::Float(x) => whole(x).map_err(|()| wrong()),
            Token::Null => Ok(0),
            Token::Other => Err(wrong()),
        }
    }
}

/// A number written with an exponent (`1e2`) or a zero fraction (`100.0`), which protobuf's JSON reads as
/// the integer it is; not one with a fraction, a negative one, or one past 2^53 (where a double no longer
/// holds every integer).
fn whole(x: f64) -> Result<u64, ()> {
    const EXACT: f64 = 9_007_199_254_740_992.0;
    if x.fract() == 0.0 && (0.0..=EXACT).contains(&x) {
        Ok(x as u64)
    } else {
        Err(())
    }
}

/// Reads a [`Token`] for a field (its name, and what it expects, for the error an object or an array
/// gets at once).
struct Scalar(&'static str, &'static str);

impl<'de> DeserializeSeed<'de> for Scalar {
    type Value = Token<'de>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Token<'de>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Scalar {
    type Value = Token<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.0, self.1)
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Token<'de>, E> {
        Ok(Token::Str(Cow::Borrowed(v)))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Token<'de>, E> {
        Ok(Token::Str(Cow::Owned(v.to_owned())))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Token<'de>, E> {
        Ok(Token::Unsigned(v))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Token<'de>, E> {
        Ok(Token::Other)
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Token<'de>, E> {
        Ok(Token::Float(v))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Token<'de>, E> {
        Ok(Token::Other)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Token<'de>, E> {
        Ok(Token::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Token<'de>, A::Error> {
        Err(de::Error::custom(format!(
            "{}: expected {}",
            self.0, self.1
        )))
    }
    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Token<'de>, A::Error> {
        Err(de::Error::custom(format!(
            "{}: expected {}",
            self.0, self.1
        )))
    }
}

/// A field name, borrowed from the body unless it holds escapes.
struct Name<'de>(Cow<'de, str>);

impl<'de> de::Deserialize<'de> for Name<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Scalar("a field name", "a string").deserialize(d)? {
            Token::Str(s) => Ok(Name(s)),
            _ => Err(de::Error::custom("a field name: expected a string")),
        }
    }
}

/// Visitor methods refusing a string, a number or a boolean with `$refuse`, an expression of the
/// visitor (`$this`) that makes the error.
macro_rules! refuse_scalars {
    ($value:ty, |$this:ident| $refuse:expr) => {
        fn visit_str<E: de::Error>(self, _: &str) -> Result<$value, E> {
            let $this = self;
            Err($refuse)
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<$value, E> {
            let $this = self;
            Err($refuse)
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<$value, E> {
            let $this = self;
            Err($refuse)
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<$value, E> {
            let $this = self;
            Err($refuse)
        }
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<$value, E> {
            let $this = self;
            Err($refuse)
        }
    };
}

/// A message, or `None` for `null`.
struct Nullable<'l, M> {
    limits: &'l RequestLimits,
    message: PhantomData<M>,
}

impl<'l, M> Nullable<'l, M> {
    fn new(limits: &'l RequestLimits) -> Self {
        Self {
            limits,
            message: PhantomData,
        }
    }
}

impl<'de, M: Message> DeserializeSeed<'de> for Nullable<'_, M> {
    type Value = Option<M>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<M>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, M: Message> Visitor<'de> for Nullable<'_, M> {
    type Value = Option<M>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: a JSON object", M::NAME)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Option<M>, E> {
        Ok(None)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<M>, A::Error> {
        let mut message = M::default();
        // Each field once, under either of its names (protobuf's JSON refuses a repeated field: read
        // last-wins, a request could count in another domain than a proxy in front of it read).
        let mut seen: Vec<String> = Vec::new();
        while let Some(Name(name)) = map.next_key()? {
            let field: String = name
                .chars()
                .filter(|&c| c != '_')
                .map(|c| c.to_ascii_lowercase())
                .collect();
            if seen.contains(&field) {
                return Err(de::Error::custom(format!(
                    "field {:?} is written twice in {}",
                    quoted(&name),
                    M::NAME
                )));
            }
            if !message.field(&name, &mut map, self.limits)? {
                return Err(de::Error::custom(format!(
                    "unknown field {:?} in {}",
                    quoted(&name),
                    M::NAME
                )));
            }
            seen.push(field);
        }
        Ok(Some(message))
    }
    refuse_scalars!(Option<M>, |_this| not_an_object::<M, _>());
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Option<M>, A::Error> {
        Err(not_an_object::<M, A::Error>())
    }
}

fn not_an_object<M: Message, E: de::Error>() -> E {
    E::custom(format!("{}: expected a JSON object", M::NAME))
}

/// A repeated message field (`null` reads as empty), refused past its most items.
struct List<'l, M> {
    field: &'static str,
    most: (usize, &'static str),
    limits: &'l RequestLimits,
    item: PhantomData<M>,
}

impl<'de, M: Message> DeserializeSeed<'de> for List<'_, M> {
    type Value = Vec<M>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Vec<M>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, M: Message> Visitor<'de> for List<'_, M> {
    type Value = Vec<M>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: a JSON array", self.field)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Vec<M>, E> {
        Ok(Vec::new())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<M>, A::Error> {
        let (most, setting) = self.most;
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(Nullable::<M>::new(self.limits))? {
            let Some(item) = item else {
                return Err(not_an_object::<M, A::Error>());
            };
            if items.len() == most {
                return Err(de::Error::custom(format!(
                    "{}: more than {most} ({setting})",
                    self.field
                )));
            }
            items.push(item);
        }
        Ok(items)
    }
    refuse_scalars!(Vec<M>, |this| this.not_an_array());
    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Vec<M>, A::Error> {
        Err(self.not_an_array())
    }
}

impl<M> List<'_, M> {
    fn not_an_array<E: de::Error>(&self) -> E {
        E::custom(format!("{}: expected a JSON array", self.field))
    }
}

fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::OverLimit => "OVER_LIMIT",
    }
}

/// Renders a response as protobuf JSON.
pub fn render_response(response: &limiter::Response) -> Value {
    let statuses: Vec<Value> = response
        .statuses
        .iter()
        .map(|s| {
            let mut status = Map::new();
            status.insert("code".into(), json!(code_name(s.code)));
            if let Some(limit) = &s.current_limit {
                let mut l = Map::new();
                if limit.requests_per_unit != 0 {
                    l.insert("requestsPerUnit".into(), json!(limit.requests_per_unit));
                }
                l.insert("unit".into(), json!(limit.unit.name()));
                if let Some(name) = &limit.name {
                    l.insert("name".into(), json!(name.as_ref()));
                }
                status.insert("currentLimit".into(), Value::Object(l));
            }
            if s.limit_remaining != 0 {
                status.insert("limitRemaining".into(), json!(s.limit_remaining));
            }
            if let Some(secs) = s.duration_until_reset {
                status.insert("durationUntilReset".into(), json!(format!("{secs}s")));
            }
            Value::Object(status)
        })
        .collect();
    let mut out = Map::new();
    out.insert(
        "overallCode".into(),
        json!(code_name(response.overall_code)),
    );
    if !statuses.is_empty() {
        out.insert("statuses".into(), Value::Array(statuses));
    }
    if !response.response_headers.is_empty() {
        let headers: Vec<Value> = response
            .response_headers
            .iter()
            .map(|(k, v)| json!({"key": k, "value": v}))
            .collect();
        out.insert("responseHeadersToAdd".into(), Value::Array(headers));
    }
    Value::Object(out)
}

/// Text of the caller's that an error quotes, at most [`QUOTED_CHARS`] characters of it: an answer
/// does not echo a whole body back.
fn quoted(text: &str) -> Cow<'_, str> {
    match text.char_indices().nth(QUOTED_CHARS) {
        Some((end, _)) => Cow::Owned(format!("{}...", &text[..end])),
        None => Cow::Borrowed(text),
    }
}

const QUOTED_CHARS: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{CurrentLimit, DescriptorStatus};

    fn parse(body: &[u8]) -> Result<limiter::Request, String> {
        parse_request(body, &RequestLimits::default())
    }

    #[test]
    fn requests_accept_json_and_proto_names() {
        let r = parse(
            br#"{"domain":"d","hits_addend":2,"descriptors":[{"entries":[{"key":"k","value":"v"}],"limit":{"requestsPerUnit":"5","unit":"HOUR"},"hitsAddend":"0"}]}"#,
        )
        .unwrap();
        assert_eq!(r.domain, "d");
        assert_eq!(r.hits_addend, 2);
        let d = &r.descriptors[0];
        assert_eq!(d.entries[0].value, "v");
        assert_eq!(d.hits_addend, Some(0));
        assert_eq!(
            d.limit,
            Some(LimitOverride {
                requests_per_unit: 5,
                unit: Some(Unit::Hour)
            })
        );
        let r = parse(br#"{"domain":"d","descriptors":[{"limit":{"unit":7}}]}"#).unwrap();
        assert_eq!(r.descriptors[0].limit.unwrap().unit, Some(Unit::Week));
        // Integers written with an exponent or a zero fraction, as numbers or strings.
        let r = parse(br#"{"hitsAddend":1e2,"descriptors":[{"hitsAddend":"3E0","limit":{"requestsPerUnit":10.0}}]}"#)
            .unwrap();
        assert_eq!(r.hits_addend, 100);
        assert_eq!(r.descriptors[0].hits_addend, Some(3));
        assert_eq!(r.descriptors[0].limit.unwrap().requests_per_unit, 10);
    }

    #[test]
    fn errors_quote_at_most_a_line_of_what_the_caller_sent() {
        let field = "f".repeat(100_000);
        let err = parse(format!(r#"{{"{field}":1}}"#).as_bytes())
            .unwrap_err()
            .to_string();
        assert!(err.len() < 200, "{} bytes: {}", err.len(), &err[..200]);
        assert!(err.contains(&format!("{}...", "f".repeat(64))), "{err}");
        let unit = "é".repeat(1_000);
        let body = format!(r#"{{"domain":"d","descriptors":[{{"limit":{{"unit":"{unit}"}}}}]}}"#);
        let err = parse(body.as_bytes()).unwrap_err().to_string();
        assert!(err.len() < 300, "{err}");
        assert!(err.contains(&format!("{}...", "é".repeat(64))), "{err}");
    }

    #[test]
    fn malformed_requests_say_what_is_wrong() {
        for (body, want) in [
            (&b"{"[..], "invalid JSON"),
            (br#"{"domian":"d"}"#, "unknown field \"domian\""),
            (br#"{"domain":5}"#, "domain: expected a string"),
            (br#"{"hitsAddend":-1}"#, "hitsAddend"),
            (
                br#"{"descriptors":[{"limit":{"unit":"FORTNIGHT"}}]}"#,
                "FORTNIGHT",
            ),
            (
                br#"{"descriptors":[null]}"#,
                "RateLimitDescriptor: expected a JSON object",
            ),
            (
                br#"{"descriptors":{}}"#,
                "descriptors: expected a JSON array",
            ),
            (
                br#"{"descriptors":[{"entries":[{"key":[1]}]}]}"#,
                "key: expected a string",
            ),
            (
                br#"{"descriptors":[{"hitsAddend":1.5}]}"#,
                "hitsAddend: expected a non-negative integer",
            ),
            (
                br#"{"descriptors":[{"wat":{"deep":[1,2,3]}}]}"#,
                "unknown field \"wat\" in RateLimitDescriptor",
            ),
            (br#"[]"#, "RateLimitRequest: expected a JSON object"),
            (br#"null"#, "RateLimitRequest: expected a JSON object"),
            (br#"{"domain":"d"} {}"#, "invalid JSON"),
            // A field written twice, under one name or both: refused, as protobuf's JSON refuses it,
            // rather than read last-wins.
            (
                br#"{"domain":"t","domain":"zzz"}"#,
                "field \"domain\" is written twice in RateLimitRequest",
            ),
            (
                br#"{"hitsAddend":1,"hits_addend":9}"#,
                "field \"hits_addend\" is written twice",
            ),
            (br#"{"hitsAddend":1e20}"#, "hitsAddend"),
            (br#"{"hitsAddend":"2.5"}"#, "hitsAddend"),
        ] {
            let err = parse(body).unwrap_err();
            assert!(err.contains(want), "{err}");
        }
    }

    #[test]
    fn more_descriptors_or_entries_than_allowed_are_refused_while_reading() {
        let limits = RequestLimits {
            max_descriptors: 2,
            max_entries: 1,
            ..RequestLimits::default()
        };
        let two = br#"{"descriptors":[{"entries":[{"key":"a"}]},{}]}"#;
        assert_eq!(parse_request(two, &limits).unwrap().descriptors.len(), 2);
        let err = parse_request(br#"{"descriptors":[{},{},{}]}"#, &limits).unwrap_err();
        assert!(
            err.contains("descriptors: more than 2 (request_limits.max_descriptors)"),
            "{err}"
        );
        let err = parse_request(br#"{"descriptors":[{"entries":[{},{}]}]}"#, &limits).unwrap_err();
        assert!(
            err.contains("entries: more than 1 (request_limits.max_entries)"),
            "{err}"
        );
    }

    #[test]
    fn escaped_names_and_values_are_read() {
        let r = parse(br#"{"dom\u0061in":"d\u00e9","descriptors":[{"entries":[{"key":"k","value":"a\"b"}]}]}"#)
            .unwrap();
        assert_eq!(r.domain, "d\u{e9}");
        assert_eq!(r.descriptors[0].entries[0].value, "a\"b");
    }

    #[test]
    fn responses_render_like_protobuf_json() {
        let response = limiter::Response {
            overall_code: Code::OverLimit,
            statuses: vec![
                DescriptorStatus {
                    code: Code::OverLimit,
                    current_limit: Some(CurrentLimit {
                        requests_per_unit: 10,
                        unit: Unit::Minute,
                        name: Some("per_ip".into()),
                    }),
                    limit_remaining: 0,
                    duration_until_reset: Some(58),
                    retry_after: None,
                },
                DescriptorStatus {
                    code: Code::Ok,
                    current_limit: None,
                    limit_remaining: 0,
                    duration_until_reset: None,
                    retry_after: None,
                },
            ],
            response_headers: vec![("RateLimit-Limit".into(), "10".into())],
        };
        assert_eq!(
            render_response(&response),
            json!({
                "overallCode": "OVER_LIMIT",
                "statuses": [
                    {"code": "OVER_LIMIT", "currentLimit": {"requestsPerUnit": 10, "unit": "MINUTE", "name": "per_ip"}, "durationUntilReset": "58s"},
                    {"code": "OK"}
                ],
                "responseHeadersToAdd": [{"key": "RateLimit-Limit", "value": "10"}]
            })
        );
    }
}
