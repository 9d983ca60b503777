//! A YAML document as a generic tree, before anything is known of rules: map order is kept (wildcards
//! match in file order) and so are non-string keys (to refuse them with the reference's message).

use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

/// A YAML node.
#[derive(Debug, Clone, PartialEq)]
pub enum Yaml {
    Null,
    Bool(bool),
    Int(i64),
    /// Integers above `i64::MAX`.
    BigUint(u64),
    Float(f64),
    String(String),
    List(Vec<Yaml>),
    Map(Vec<(Yaml, Yaml)>),
}

impl fmt::Display for Yaml {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Yaml::Null => f.write_str("null"),
            Yaml::Bool(b) => write!(f, "{b}"),
            Yaml::Int(i) => write!(f, "{i}"),
            Yaml::BigUint(u) => write!(f, "{u}"),
            Yaml::Float(x) => write!(f, "{x}"),
            Yaml::String(s) => f.write_str(s),
            Yaml::List(items) => {
                f.write_str("[")?;
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        f.write_str(" ")?;
                    }
                    write!(f, "{item}")?;
                }
                f.write_str("]")
            }
            Yaml::Map(entries) => {
                f.write_str("map[")?;
                for (i, (k, v)) in entries.iter().enumerate() {
                    if i > 0 {
                        f.write_str(" ")?;
                    }
                    write!(f, "{k}:{v}")?;
                }
                f.write_str("]")
            }
        }
    }
}

impl<'de> Deserialize<'de> for Yaml {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(YamlVisitor)
    }
}

/// Builds a [`Yaml`] from whatever the parser reads.
struct YamlVisitor;

impl<'de> Visitor<'de> for YamlVisitor {
    type Value = Yaml;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any YAML value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Yaml, E> {
        Ok(Yaml::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Yaml, E> {
        Ok(Yaml::Int(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Yaml, E> {
        Ok(i64::try_from(v).map_or(Yaml::BigUint(v), Yaml::Int))
    }
    fn visit_i128<E>(self, v: i128) -> Result<Yaml, E> {
        Ok(i64::try_from(v).map_or(Yaml::Float(v as f64), Yaml::Int))
    }
    fn visit_u128<E>(self, v: u128) -> Result<Yaml, E> {
        Ok(u64::try_from(v).map_or(Yaml::Float(v as f64), |v| {
            i64::try_from(v).map_or(Yaml::BigUint(v), Yaml::Int)
        }))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Yaml, E> {
        Ok(Yaml::Float(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Yaml, E> {
        Ok(Yaml::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Yaml, E> {
        Ok(Yaml::String(v))
    }
    fn visit_unit<E>(self) -> Result<Yaml, E> {
        Ok(Yaml::Null)
    }
    fn visit_none<E>(self) -> Result<Yaml, E> {
        Ok(Yaml::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Yaml, D::Error> {
        Yaml::deserialize(d)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Yaml, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Yaml::List(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Yaml, A::Error> {
        let mut entries = Vec::new();
        while let Some((k, v)) = map.next_entry()? {
            entries.push((k, v));
        }
        Ok(Yaml::Map(entries))
    }
}

impl Yaml {
    /// The value as the reference's own messages print it, cut after a few words: a list item or a key
    /// that is a whole text (a file of secrets read by mistake) is never repeated in full.
    pub fn shown(&self) -> String {
        const FULL: usize = 40;
        const KEPT: usize = 32;
        let text = self.to_string();
        let length = text.chars().count();
        if length <= FULL {
            return text;
        }
        let kept: String = text.chars().take(KEPT).collect();
        format!("{kept}... ({length} characters)")
    }

    /// The value as the reference's YAML decoder names it in type errors: a short scalar in full, a
    /// longer one by its first seven characters, a list or a map by its kind alone. A file that is not
    /// a rules file at all (a whole text read as one scalar) is thus never repeated in a message.
    pub fn brief(&self) -> String {
        match self {
            Yaml::List(_) => "!!seq".into(),
            Yaml::Map(_) => "!!map".into(),
            scalar => {
                let text = scalar.to_string();
                if text.chars().count() > 10 {
                    format!("`{}...`", text.chars().take(7).collect::<String>())
                } else {
                    format!("`{text}`")
                }
            }
        }
    }
}
