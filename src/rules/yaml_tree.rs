//! A YAML document as a generic tree, before anything is known of rules: map order is kept (wildcards
//! match in file order) and so are non-string keys (to refuse them with the reference's message), and a
//! plain scalar read as a number or a boolean keeps its spelling, which a text field takes as written.

use std::{cell::RefCell, fmt};

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_saphyr::Spanned;

/// A YAML node.
#[derive(Debug, Clone, PartialEq)]
pub enum Yaml {
    Null,
    /// A boolean, and its spelling (`True`, `false`).
    Bool(bool, Box<str>),
    /// An integer, and its spelling (`0x1F`, `+42`, `1_000`): the reference's decoder gives a text field
    /// the scalar as written, not the number.
    Int(i64, Box<str>),
    /// Integers above `i64::MAX`.
    BigUint(u64),
    Float(f64),
    String(String),
    List(Vec<Yaml>),
    /// A map's entries, and the line it starts on (from 1; 0 when not known), which messages about
    /// the rule or the block it writes name.
    Map(Vec<(Yaml, Yaml)>, u32),
}

impl fmt::Display for Yaml {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Yaml::Null => f.write_str("null"),
            Yaml::Bool(_, text) | Yaml::Int(_, text) => f.write_str(text),
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
            Yaml::Map(entries, _) => {
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

thread_local! {
    /// The text [`Yaml::spelled_in`] is parsing on this thread, where a scalar's spelling is read.
    static SOURCE: RefCell<Option<String>> = const { RefCell::new(None) };
}

impl Yaml {
    /// Runs `parse` (which deserializes [`Yaml`] from `text`) so that the numbers and booleans it reads
    /// keep their spelling in `text`.
    pub fn spelled_in<T>(text: &str, parse: impl FnOnce() -> T) -> T {
        struct Clear;
        impl Drop for Clear {
            fn drop(&mut self) {
                SOURCE.with(|s| s.borrow_mut().take());
            }
        }
        SOURCE.with(|s| *s.borrow_mut() = Some(text.to_owned()));
        let _clear = Clear;
        parse()
    }

    /// A node read with its place in the source: a number or a boolean takes its spelling there.
    fn from_spanned(node: Spanned<Yaml>) -> Yaml {
        let span = node.defined.span();
        match node.value {
            Yaml::Bool(b, text) => Yaml::Bool(b, spelling(span).unwrap_or(text)),
            Yaml::Int(i, text) => Yaml::Int(i, spelling(span).unwrap_or(text)),
            // Where the map is used: an alias's own line, not its anchor's.
            Yaml::Map(entries, _) => {
                Yaml::Map(entries, u32::try_from(node.referenced.line()).unwrap_or(0))
            }
            other => other,
        }
    }
}

/// The source text at `span`, when a text is being parsed and the span is within it.
fn spelling(span: serde_saphyr::Span) -> Option<Box<str>> {
    let start = usize::try_from(span.byte_offset()?).ok()?;
    let len = usize::try_from(span.byte_len()?).ok()?;
    SOURCE.with(|s| {
        let source = s.borrow();
        let text = source
            .as_deref()?
            .get(start..start.checked_add(len)?)?
            .trim();
        // A quoted scalar tagged as a number (`!!int "0x1F"`): the text between the quotes, when it
        // holds no escape or line break; other styles are left to the number.
        let plain = match text.as_bytes().first()? {
            b'"' | b'\'' => text.get(1..text.len().checked_sub(1)?)?,
            b'|' | b'>' | b'!' | b'&' | b'*' => return None,
            _ => text,
        };
        let clean = !plain.contains(['\\', '"', '\'', '\n', '\r']);
        (clean && !plain.is_empty()).then(|| plain.into())
    })
}

/// An integer spelled as Rust prints it, until its spelling in the source is known.
fn int(v: i64) -> Yaml {
    Yaml::Int(v, v.to_string().into())
}

/// Builds a [`Yaml`] from whatever the parser reads.
struct YamlVisitor;

impl<'de> Visitor<'de> for YamlVisitor {
    type Value = Yaml;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any YAML value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Yaml, E> {
        Ok(Yaml::Bool(v, v.to_string().into()))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Yaml, E> {
        Ok(int(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Yaml, E> {
        Ok(i64::try_from(v).map_or(Yaml::BigUint(v), int))
    }
    fn visit_i128<E>(self, v: i128) -> Result<Yaml, E> {
        Ok(i64::try_from(v).map_or(Yaml::Float(v as f64), int))
    }
    fn visit_u128<E>(self, v: u128) -> Result<Yaml, E> {
        Ok(u64::try_from(v).map_or(Yaml::Float(v as f64), |v| {
            i64::try_from(v).map_or(Yaml::BigUint(v), int)
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
            items.push(Yaml::from_spanned(item));
        }
        Ok(Yaml::List(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Yaml, A::Error> {
        let mut entries = Vec::new();
        // Keys without their place: a rules file's keys are field names (a number there is refused),
        // and reading a node's place costs as much again as the node.
        while let Some((k, v)) = map.next_entry::<Yaml, Spanned<Yaml>>()? {
            entries.push((k, Yaml::from_spanned(v)));
        }
        Ok(Yaml::Map(entries, 0))
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
            Yaml::Map(..) => "!!map".into(),
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
