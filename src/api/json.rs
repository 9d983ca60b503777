//! The protobuf JSON mapping of `RateLimitRequest` and `RateLimitResponse`, for `/json`.
//!
//! Requests accept both the lowerCamelCase JSON names and the proto field names, enums by name or
//! number, and 64-bit integers as numbers or strings, as protobuf JSON parsers do; unknown fields are
//! refused. Responses use lowerCamelCase, enum names, durations like `"58s"`, and omit default values.

use serde_json::{json, Map, Value};

use crate::{
    limiter::{self, Code, LimitOverride},
    rules::Unit,
};

/// Parses a protobuf-JSON `RateLimitRequest`.
pub fn parse_request(body: &[u8]) -> Result<limiter::Request, String> {
    let value: Value = serde_json::from_slice(body).map_err(|e| format!("invalid JSON: {e}"))?;
    let obj = object(&value, "RateLimitRequest")?;
    let mut request = limiter::Request::default();
    for (name, v) in obj {
        match name.as_str() {
            "domain" => request.domain = string(v, "domain")?,
            "descriptors" => {
                for d in array(v, "descriptors")? {
                    request.descriptors.push(descriptor(d)?);
                }
            }
            "hitsAddend" | "hits_addend" => {
                request.hits_addend = u32::try_from(integer(v, "hitsAddend")?)
                    .map_err(|_| "hitsAddend: out of range for uint32".to_string())?
            }
            other => return Err(format!("unknown field {other:?} in RateLimitRequest")),
        }
    }
    Ok(request)
}

fn descriptor(value: &Value) -> Result<limiter::Descriptor, String> {
    let mut d = limiter::Descriptor::default();
    for (name, v) in object(value, "RateLimitDescriptor")? {
        match name.as_str() {
            "entries" => {
                for e in array(v, "entries")? {
                    let mut entry = limiter::Entry::default();
                    for (name, v) in object(e, "Entry")? {
                        match name.as_str() {
                            "key" => entry.key = string(v, "key")?,
                            "value" => entry.value = string(v, "value")?,
                            other => return Err(format!("unknown field {other:?} in Entry")),
                        }
                    }
                    d.entries.push(entry);
                }
            }
            "limit" => {
                if !v.is_null() {
                    d.limit = Some(limit_override(v)?);
                }
            }
            "hitsAddend" | "hits_addend" => {
                if !v.is_null() {
                    d.hits_addend = Some(integer(v, "hitsAddend")?);
                }
            }
            other => return Err(format!("unknown field {other:?} in RateLimitDescriptor")),
        }
    }
    Ok(d)
}

fn limit_override(value: &Value) -> Result<LimitOverride, String> {
    let mut over = LimitOverride {
        requests_per_unit: 0,
        unit: None,
    };
    for (name, v) in object(value, "RateLimitOverride")? {
        match name.as_str() {
            "requestsPerUnit" | "requests_per_unit" => {
                over.requests_per_unit = u32::try_from(integer(v, "requestsPerUnit")?)
                    .map_err(|_| "requestsPerUnit: out of range for uint32".to_string())?
            }
            "unit" => {
                over.unit = match v {
                    Value::String(s) if s == "UNKNOWN" => None,
                    Value::String(s) => Some(
                        Unit::from_name(s)
                            .filter(|_| s.chars().all(|c| c.is_ascii_uppercase()))
                            .ok_or_else(|| format!("unit: unknown enum value {s:?}"))?,
                    ),
                    Value::Number(_) => i32::try_from(integer(v, "unit")?)
                        .ok()
                        .and_then(Unit::from_wire),
                    Value::Null => None,
                    _ => return Err("unit: expected an enum name or number".into()),
                }
            }
            other => return Err(format!("unknown field {other:?} in RateLimitOverride")),
        }
    }
    Ok(over)
}

fn object<'a>(v: &'a Value, what: &str) -> Result<&'a Map<String, Value>, String> {
    v.as_object()
        .ok_or_else(|| format!("{what}: expected a JSON object"))
}

fn array<'a>(v: &'a Value, field: &str) -> Result<&'a [Value], String> {
    match v {
        Value::Array(items) => Ok(items),
        Value::Null => Ok(&[]),
        _ => Err(format!("{field}: expected a JSON array")),
    }
}

fn string(v: &Value, field: &str) -> Result<String, String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        _ => Err(format!("{field}: expected a string")),
    }
}

/// A non-negative integer, as a JSON number or a decimal string.
fn integer(v: &Value, field: &str) -> Result<u64, String> {
    match v {
        Value::Number(n) => n
            .as_u64()
            .ok_or_else(|| format!("{field}: expected a non-negative integer")),
        Value::String(s) => s
            .parse()
            .map_err(|_| format!("{field}: expected a non-negative integer")),
        Value::Null => Ok(0),
        _ => Err(format!("{field}: expected a non-negative integer")),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{CurrentLimit, DescriptorStatus};

    #[test]
    fn requests_accept_json_and_proto_names() {
        let r = parse_request(
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
        let r = parse_request(br#"{"domain":"d","descriptors":[{"limit":{"unit":7}}]}"#).unwrap();
        assert_eq!(r.descriptors[0].limit.unwrap().unit, Some(Unit::Week));
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
        ] {
            let err = parse_request(body).unwrap_err();
            assert!(err.contains(want), "{err}");
        }
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
