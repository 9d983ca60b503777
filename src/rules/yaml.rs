//! Reading one rules file: YAML text -> generic tree -> key validation -> typed [`DomainFile`].
//!
//! The reference service parses in two passes (validate every map key against one flat set of names, then
//! decode into typed structs) and its error texts are part of what operators grep for, so both passes and
//! their messages are kept here.

use super::{
    error::{Location, ParseError, SyntaxProblem},
    flags::RuleFlags,
    yaml_tree::Yaml,
    DEFAULT_MAX_YAML_NODES,
};

/// Every key name accepted anywhere in a rules file besides the [`RuleFlags`] (one flat set, as the
/// reference checks it).
const VALID_KEYS: &[&str] = &[
    "domain",
    "key",
    "value",
    "descriptors",
    "rate_limit",
    "unit",
    "requests_per_unit",
    "unlimited",
    "name",
    "replaces",
    "metadata",
    // ratelimitd's extensions.
    "rate_limits",
    "algorithm",
    "burst",
    "unit_multiplier",
    "count_over_limit",
];

/// A rules file as written, after both passes of validation.
#[derive(Debug, Clone, PartialEq)]
pub struct DomainFile {
    pub domain: String,
    pub descriptors: Vec<DescriptorSpec>,
    /// Fields written where they mean nothing (`shadow_mode` inside a `rate_limit`, `burst` beside
    /// one): valid names, so accepted as the reference accepts them, and ignored; said at each load.
    pub ignored: Vec<String>,
}

/// The fields of a `rate_limit` block.
const RATE_LIMIT_KEYS: &[&str] = &[
    "unit",
    "requests_per_unit",
    "unlimited",
    "name",
    "replaces",
    "algorithm",
    "burst",
    "unit_multiplier",
    "count_over_limit",
];

/// The fields of a descriptor besides its flags.
const DESCRIPTOR_KEYS: &[&str] = &[
    "key",
    "value",
    "descriptors",
    "rate_limit",
    "rate_limits",
    "metadata",
];

/// One descriptor node of a rules file.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DescriptorSpec {
    pub key: String,
    pub value: String,
    pub rate_limit: Option<RateLimitSpec>,
    /// Further limits on the same rule (`rate_limits:`).
    pub rate_limits: Vec<RateLimitSpec>,
    pub descriptors: Vec<DescriptorSpec>,
    pub flags: RuleFlags,
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
    /// The line the descriptor starts on in its file (from 1; 0 for rules not from a file), which
    /// the errors about it name.
    pub line: u32,
}

/// The `rate_limit` block of a descriptor node, before unit validation.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RateLimitSpec {
    pub unit: String,
    pub requests_per_unit: u32,
    pub unlimited: bool,
    pub name: String,
    pub replaces: Vec<String>,
    /// Empty: the default algorithm.
    pub algorithm: String,
    pub burst: Option<u64>,
    /// Written as an integer; `None` when absent.
    pub unit_multiplier: Option<i64>,
    /// Every hit is counted, also past the limit (usage reported after the fact).
    pub count_over_limit: bool,
}

/// Deepest a rules file's YAML may nest (maps and lists): 31 levels of descriptors.
pub const MAX_YAML_DEPTH: usize = 64;

/// Most YAML events aliases (`*name`) may replay in a file of at most `max_yaml_nodes` nodes.
pub fn max_alias_replay(max_yaml_nodes: usize) -> usize {
    (max_yaml_nodes / 4).max(100_000)
}

/// Parses and validates the text of one rules file with the default node budget. Messages are those of
/// the reference service, without the `<file>: ` prefix the caller adds.
pub fn parse_file(text: &str) -> Result<DomainFile, ParseError> {
    parse_file_within(text, DEFAULT_MAX_YAML_NODES)
}

/// Stack of the thread a file is parsed on. Reading YAML recurses at every level, and a level takes tens
/// of kilobytes of stack in a debug build: the [`MAX_YAML_DEPTH`] levels a file may have must fit
/// whichever thread loads the rules (a runtime's worker has 2 MiB).
const PARSE_STACK_BYTES: usize = 32 << 20;

/// [`parse_file`], refusing a file of more than `max_yaml_nodes` YAML nodes (`rules.max_yaml_nodes`).
pub fn parse_file_within(text: &str, max_yaml_nodes: usize) -> Result<DomainFile, ParseError> {
    std::thread::scope(|scope| {
        let parse = || parse_here(text, max_yaml_nodes);
        match std::thread::Builder::new()
            .name("rules-parse".into())
            .stack_size(PARSE_STACK_BYTES)
            .spawn_scoped(scope, parse)
        {
            Ok(thread) => thread
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
            // No thread to be had: on this one, which holds the usual files.
            Err(_) => parse(),
        }
    })
}

fn parse_here(text: &str, max_yaml_nodes: usize) -> Result<DomainFile, ParseError> {
    // YAML 1.2 booleans only, so that values such as `on`, `no` or `y` stay text, and numbers with a
    // leading zero stay text too (`value: 010` is the string "010").
    let mut options = serde_saphyr::Options::default();
    options.strict_booleans = true;
    options.leading_zero_numbers_as_strings = true;
    // Messages carry a line and column, never the file's text (see `syntax_error`).
    options.with_snippet = false;
    let mut budget = serde_saphyr::Budget::default();
    budget.max_nodes = max_yaml_nodes;
    // Every node is one event, and closing a map or a list one more: this bound never trips before the
    // node budget does, which names the setting.
    budget.max_events = max_yaml_nodes.saturating_mul(2).saturating_add(4096);
    // Aliases, anchors and merge keys are nodes too: one block shared by every rule (`rate_limit:
    // *std`, `<<: *base`) is how large files are written, and yaml.v2 reads any number of them.
    budget.max_aliases = max_yaml_nodes;
    budget.max_anchors = max_yaml_nodes;
    budget.max_merge_keys = max_yaml_nodes;
    budget.enforce_alias_anchor_ratio = false;
    budget.max_depth = MAX_YAML_DEPTH;
    budget.flow_nesting_limit = MAX_YAML_DEPTH;
    options.budget = Some(budget);
    // What aliases replay: a quarter of the node budget (250 000 YAML events by default: 50 000 rules
    // sharing a one-line rate_limit), so that an alias bomb (aliases doubling at every level) is refused
    // after a fraction of a second's work.
    options.alias_limits.max_total_replayed_events = max_alias_replay(max_yaml_nodes);
    // A key written twice in one map is read as the reference reads it, the last one winning (see
    // `keep_last`).
    options.duplicate_keys = serde_saphyr::options::DuplicateKeyPolicy::PassThrough;
    // Like the reference, only the first document counts: what follows it is not even parsed.
    let first = first_document(text);
    let docs: Vec<Yaml> = Yaml::spelled_in(first, || {
        serde_saphyr::from_multiple_with_options(first, options)
    })
    .map_err(|e| syntax_error(&e, max_yaml_nodes))?;
    let mut root = docs.into_iter().next().unwrap_or(Yaml::Null);
    let mut ignored = Vec::new();
    keep_last(&mut root, &mut ignored);
    validate_keys(&root)?;
    let mut domain = String::new();
    let mut descriptors = Vec::new();
    if let Yaml::Map(entries, _) = &root {
        for (k, v) in entries {
            match key_str(k) {
                "domain" => domain = scalar_string(v, "domain")?,
                "descriptors" => descriptors = descriptor_list(v, &mut ignored)?,
                other => ignored.push(format!("'{other}' at the top of the file is ignored: only domain and descriptors are read there")),
            }
        }
    } else if !matches!(root, Yaml::Null) {
        return Err(unmarshal_error(&root, "the file", "a map"));
    }
    Ok(DomainFile {
        domain,
        descriptors,
        ignored,
    })
}

/// The message for a file the YAML parser refused: where, and what kind of problem, in the reference's
/// `error loading config file: yaml: ...` form. The parser's text is used only for the errors known to
/// describe the problem without quoting the file (syntax errors name a bracket or a quote at most); the
/// others are named by their kind, so that no file content reaches a log line or `check-config`.
fn syntax_error(err: &serde_saphyr::Error, max_yaml_nodes: usize) -> ParseError {
    use serde_saphyr::{budget::BudgetBreach, Error};
    // The error itself, out of the wrappers that add a snippet or the place an alias was defined.
    let mut inner = err;
    while let Error::WithSnippet { error, .. } | Error::AliasError { error, .. } = inner {
        inner = error;
    }
    let at = Location {
        line_column: inner
            .location()
            .or_else(|| err.location())
            .map(|l| (l.line(), l.column())),
    };
    let err = inner;
    // "<what> at line L, column C", first line only: the location is written in front instead.
    let own_text = || {
        let text = err.to_string();
        let first = text.lines().next().unwrap_or_default();
        first
            .rsplit_once(" at line ")
            .map_or(first, |(what, _)| what)
            .trim()
            .to_owned()
    };
    let problem = match err {
        Error::Budget {
            breach:
                BudgetBreach::Nodes { .. }
                | BudgetBreach::Events { .. }
                | BudgetBreach::Aliases { .. }
                | BudgetBreach::Anchors { .. }
                | BudgetBreach::MergeKeys { .. },
            ..
        }
        | Error::AliasReplayLimitExceeded { .. } => SyntaxProblem::TooManyNodes(max_yaml_nodes),
        Error::Budget {
            breach: BudgetBreach::Depth { .. },
            ..
        } => SyntaxProblem::TooDeep(MAX_YAML_DEPTH),
        // The scanner's own limit on flow (`[...]`, `{...}`) nesting, which is set to the same depth.
        Error::ExternalMessage { msg, .. } if msg == "recursion limit exceeded" => {
            SyntaxProblem::TooDeep(MAX_YAML_DEPTH)
        }
        Error::DuplicateMappingKey { .. } => SyntaxProblem::DuplicateKey,
        Error::NonFiniteFloat { .. } => SyntaxProblem::NotFinite,
        Error::ExternalMessage { .. }
        | Error::Budget { .. }
        | Error::UnknownAnchor { .. }
        | Error::AliasExpansionLimitExceeded { .. }
        | Error::AliasReplayStackDepthExceeded { .. }
        | Error::InvalidScalar { .. }
        | Error::Eof { .. } => SyntaxProblem::Described(own_text()),
        _ => SyntaxProblem::NotRules,
    };
    ParseError::Syntax { at, problem }
}

/// The text of a file's first YAML document: up to the line that starts the next (`---`) or ends this
/// one (`...`). Such a line at the start of a line is always a document marker (no scalar may hold
/// one there), so the cut needs no parsing. The reference's decoder reads the first document only, and
/// never sees a fault in the others.
fn first_document(text: &str) -> &str {
    let mut begun = false;
    let mut at = 0;
    for line in text.split_inclusive('\n') {
        let bare = line.trim_end_matches(['\n', '\r']);
        let marked = |marker: &str| {
            bare.strip_prefix(marker)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t']))
        };
        if marked("...") || (begun && marked("---")) {
            return &text[..at];
        }
        let blank = bare.trim().is_empty() || bare.trim_start().starts_with('#');
        // The first document has begun with its own marker or its first content (a directive, `%`,
        // comes before its marker).
        if !blank && !bare.starts_with('%') {
            begun = true;
        }
        at += line.len();
    }
    text
}

/// Drops, in every map, the entries whose key is written again later in it, with a warning each: the
/// reference's YAML decoder reads such a file without a word, each key's last value winning, and a
/// refusal would keep every rule of the file from loading.
fn keep_last(node: &mut Yaml, ignored: &mut Vec<String>) {
    match node {
        Yaml::Map(entries, _) => {
            // Where each key is written last.
            let mut last = std::collections::HashMap::with_capacity(entries.len());
            for (i, (k, _)) in entries.iter().enumerate() {
                if let Yaml::String(name) = k {
                    last.insert(name.clone(), i);
                }
            }
            if last.len() < entries.len() {
                let mut i = 0;
                entries.retain(|(k, _)| {
                    let kept = !matches!(k, Yaml::String(name) if last.get(name) != Some(&i));
                    if !kept {
                        ignored.push(format!(
                            "'{}' is written twice in one map: the last one is read, as the reference reads it",
                            k.shown()
                        ));
                    }
                    i += 1;
                    kept
                });
            }
            for (_, v) in entries.iter_mut() {
                keep_last(v, ignored);
            }
        }
        Yaml::List(items) => items.iter_mut().for_each(|item| keep_last(item, ignored)),
        _ => {}
    }
}

/// First pass: map keys must be strings from [`VALID_KEYS`]; list items must be maps; leaves must be
/// strings, integers, booleans or null. `metadata` contents are free-form.
fn validate_keys(node: &Yaml) -> Result<(), ParseError> {
    match node {
        Yaml::Map(entries, line) => {
            let in_this_map = |error: ParseError| error.at_line(*line);
            for (k, v) in entries {
                let Yaml::String(name) = k else {
                    return Err(in_this_map(ParseError::KeyNotString(k.shown())));
                };
                if !VALID_KEYS.contains(&name.as_str()) && !RuleFlags::KEYS.contains(&name.as_str())
                {
                    return Err(in_this_map(ParseError::UnknownKey(name.clone())));
                }
                if name != "metadata" {
                    validate_keys(v).map_err(in_this_map)?;
                }
            }
            Ok(())
        }
        Yaml::List(items) => {
            for item in items {
                if !matches!(item, Yaml::Map(..)) {
                    return Err(ParseError::ListItemNotMap(item.shown()));
                }
                validate_keys(item)?;
            }
            Ok(())
        }
        Yaml::Null | Yaml::Bool(..) | Yaml::Int(..) | Yaml::String(_) => Ok(()),
        Yaml::BigUint(_) | Yaml::Float(_) => Err(ParseError::UnsupportedNumber),
    }
}

/// Key of a map entry already checked by [`validate_keys`].
fn key_str(k: &Yaml) -> &str {
    match k {
        Yaml::String(s) => s,
        _ => "",
    }
}

fn unmarshal_error(found: &Yaml, field: &str, expected: &'static str) -> ParseError {
    ParseError::WrongType {
        found: found.brief(),
        field: field.into(),
        expected,
    }
}

/// A string field; like the reference's YAML decoder, integer and boolean scalars are taken as text, as
/// written (`0x1F`, `True`, `+42`).
fn scalar_string(v: &Yaml, field: &str) -> Result<String, ParseError> {
    match v {
        Yaml::Null => Ok(String::new()),
        Yaml::String(s) => Ok(s.clone()),
        Yaml::Int(_, text) | Yaml::Bool(_, text) => Ok(text.to_string()),
        other => Err(unmarshal_error(other, field, "a string")),
    }
}

/// A yes/no field. Plain `yes`, `on`, `y` and their opposites are text to the parser (so that a value
/// written `on` stays the text `on`), but a flag written so is a boolean to the reference's YAML 1.1
/// decoder, in the spellings it knows.
fn boolean(v: &Yaml, field: &str) -> Result<bool, ParseError> {
    match v {
        Yaml::Null => Ok(false),
        Yaml::Bool(b, _) => Ok(*b),
        Yaml::String(s) => match s.as_str() {
            "y" | "Y" | "yes" | "Yes" | "YES" | "on" | "On" | "ON" => Ok(true),
            "n" | "N" | "no" | "No" | "NO" | "off" | "Off" | "OFF" => Ok(false),
            _ => Err(unmarshal_error(v, field, "true or false")),
        },
        other => Err(unmarshal_error(other, field, "true or false")),
    }
}

fn list<'a>(v: &'a Yaml, field: &str) -> Result<&'a [Yaml], ParseError> {
    match v {
        Yaml::Null => Ok(&[]),
        Yaml::List(items) => Ok(items),
        other => Err(unmarshal_error(other, field, "a list")),
    }
}

fn map<'a>(v: &'a Yaml, field: &str) -> Result<&'a [(Yaml, Yaml)], ParseError> {
    match v {
        Yaml::Null => Ok(&[]),
        Yaml::Map(entries, _) => Ok(entries),
        other => Err(unmarshal_error(other, field, "a map")),
    }
}

fn descriptor_list(v: &Yaml, ignored: &mut Vec<String>) -> Result<Vec<DescriptorSpec>, ParseError> {
    list(v, "descriptors")?
        .iter()
        .map(|d| descriptor(d, ignored))
        .collect()
}

/// The line a map starts on; 0 for anything else, or when not known.
fn line_of(v: &Yaml) -> u32 {
    match v {
        Yaml::Map(_, line) => *line,
        _ => 0,
    }
}

/// A descriptor; an error in it (or in one nested in it) names the line it starts on.
fn descriptor(v: &Yaml, ignored: &mut Vec<String>) -> Result<DescriptorSpec, ParseError> {
    let line = line_of(v);
    let mut spec = descriptor_fields(v, ignored).map_err(|e| e.at_line(line))?;
    spec.line = line;
    Ok(spec)
}

fn descriptor_fields(v: &Yaml, ignored: &mut Vec<String>) -> Result<DescriptorSpec, ParseError> {
    let mut spec = DescriptorSpec::default();
    // Fields of a rate limit written beside it, and flags written inside it.
    let mut beside = Vec::new();
    let mut inside = Vec::new();
    for (k, v) in map(v, "descriptor")? {
        match key_str(k) {
            "key" => spec.key = scalar_string(v, "key")?,
            "value" => spec.value = scalar_string(v, "value")?,
            // Written empty: no limit, an allow-list entry, as with the reference.
            "rate_limit" if matches!(v, Yaml::Null) => {}
            "rate_limit" => spec.rate_limit = Some(rate_limit(v, &mut inside)?),
            "rate_limits" => {
                for item in list(v, "rate_limits")? {
                    spec.rate_limits.push(rate_limit(item, &mut inside)?);
                }
            }
            "descriptors" => spec.descriptors = descriptor_list(v, ignored)?,
            "metadata" => spec.metadata = metadata(v)?,
            key => match spec.flags.by_key(key) {
                Some(flag) => *flag = boolean(v, key)?,
                None => beside.push(key.to_owned()),
            },
        }
    }
    let at = if spec.value.is_empty() {
        format!("descriptor '{}'", spec.key)
    } else {
        format!("descriptor '{}: {}'", spec.key, spec.value)
    };
    for key in beside {
        let why = if RATE_LIMIT_KEYS.contains(&key.as_str()) {
            "a field of rate_limit, not of the descriptor"
        } else {
            "not a field of a descriptor"
        };
        ignored.push(format!("{at}: '{key}' is ignored: {why}"));
    }
    for key in inside {
        let why =
            if RuleFlags::KEYS.contains(&key.as_str()) || DESCRIPTOR_KEYS.contains(&key.as_str()) {
                "a field of the descriptor, not of rate_limit"
            } else {
                "not a field of rate_limit"
            };
        ignored.push(format!("{at}: '{key}' in its rate limit is ignored: {why}"));
    }
    Ok(spec)
}

/// A `rate_limit` block (or one of `rate_limits`); the names of fields it has that mean nothing there
/// go to `ignored`.
fn rate_limit(v: &Yaml, ignored: &mut Vec<String>) -> Result<RateLimitSpec, ParseError> {
    rate_limit_fields(v, ignored).map_err(|e| e.at_line(line_of(v)))
}

fn rate_limit_fields(v: &Yaml, ignored: &mut Vec<String>) -> Result<RateLimitSpec, ParseError> {
    let mut spec = RateLimitSpec::default();
    for (k, v) in map(v, "rate_limit")? {
        match key_str(k) {
            "unit" => spec.unit = scalar_string(v, "unit")?,
            "requests_per_unit" => {
                spec.requests_per_unit = uint32(v, "requests_per_unit")?.unwrap_or(0);
            }
            "unlimited" => spec.unlimited = boolean(v, "unlimited")?,
            "name" => spec.name = scalar_string(v, "name")?,
            "algorithm" => spec.algorithm = scalar_string(v, "algorithm")?,
            "burst" => spec.burst = uint32(v, "burst")?.map(u64::from),
            "unit_multiplier" => spec.unit_multiplier = integer(v, "unit_multiplier")?,
            "count_over_limit" => spec.count_over_limit = boolean(v, "count_over_limit")?,
            "replaces" => spec.replaces = replaces(v)?,
            other => ignored.push(other.to_owned()),
        }
    }
    Ok(spec)
}

/// An unsigned 32-bit field; `None` when null.
fn uint32(v: &Yaml, field: &str) -> Result<Option<u32>, ParseError> {
    match v {
        Yaml::Null => Ok(None),
        Yaml::Int(i, _) => u32::try_from(*i)
            .map(Some)
            .map_err(|_| unmarshal_error(v, field, "a uint32")),
        other => Err(unmarshal_error(other, field, "a uint32")),
    }
}

/// An integer field of any sign, checked later; `None` when null.
fn integer(v: &Yaml, field: &str) -> Result<Option<i64>, ParseError> {
    match v {
        Yaml::Null => Ok(None),
        Yaml::Int(i, _) => Ok(Some(*i)),
        other => Err(unmarshal_error(other, field, "an integer")),
    }
}

/// The `name`s of a `replaces` list (`""` for an entry without one, refused when compiling).
fn replaces(v: &Yaml) -> Result<Vec<String>, ParseError> {
    let mut names = Vec::new();
    for item in list(v, "replaces")? {
        let mut name = String::new();
        for (k, v) in map(item, "replaces")? {
            if key_str(k) == "name" {
                name = scalar_string(v, "name")?;
            }
        }
        names.push(name);
    }
    Ok(names)
}

fn metadata(v: &Yaml) -> Result<Option<serde_json::Map<String, serde_json::Value>>, ParseError> {
    match v {
        Yaml::Null => Ok(None),
        Yaml::Map(entries, _) => Ok(Some(to_json_map(entries)?)),
        other => Err(ParseError::MetadataNotMap(other.brief())),
    }
}

fn to_json(v: &Yaml) -> Result<serde_json::Value, ParseError> {
    use serde_json::Value;
    Ok(match v {
        Yaml::Null => Value::Null,
        Yaml::Bool(b, _) => Value::Bool(*b),
        Yaml::Int(i, _) => Value::from(*i),
        Yaml::BigUint(u) => Value::from(*u),
        Yaml::Float(x) => serde_json::Number::from_f64(*x)
            .map(Value::Number)
            .ok_or(ParseError::MetadataNotFinite(*x))?,
        Yaml::String(s) => Value::String(s.clone()),
        Yaml::List(items) => Value::Array(items.iter().map(to_json).collect::<Result<_, _>>()?),
        Yaml::Map(entries, _) => Value::Object(to_json_map(entries)?),
    })
}

fn to_json_map(
    entries: &[(Yaml, Yaml)],
) -> Result<serde_json::Map<String, serde_json::Value>, ParseError> {
    let mut out = serde_json::Map::new();
    for (k, v) in entries {
        let Yaml::String(k) = k else {
            return Err(ParseError::MetadataKeyNotString(k.brief()));
        };
        out.insert(k.clone(), to_json(v)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_nested_file_in_order() {
        let f = parse_file(
            "---\ndomain: web\ndescriptors:\n  - key: a\n    value: 8080\n    rate_limit: {unit: Minute, requests_per_unit: 5, name: n}\n  - key: b\n    descriptors:\n      - key: c\n        shadow_mode: true\n",
        )
        .unwrap();
        assert_eq!(f.domain, "web");
        assert_eq!(f.descriptors.len(), 2);
        assert_eq!(f.descriptors[0].value, "8080");
        let rl = f.descriptors[0].rate_limit.as_ref().unwrap();
        assert_eq!(rl.unit, "Minute");
        assert_eq!((rl.requests_per_unit, rl.name.as_str()), (5, "n"));
        assert!(f.descriptors[1].descriptors[0].flags.shadow_mode);
    }

    #[test]
    fn yaml_1_1_booleans_and_leading_zeros_stay_text() {
        let f = parse_file(
            "domain: d
descriptors:
  - {key: y, value: on}
  - {key: n, value: 010}
",
        )
        .unwrap();
        assert_eq!(
            (
                f.descriptors[0].key.as_str(),
                f.descriptors[0].value.as_str()
            ),
            ("y", "on")
        );
        assert_eq!(
            (
                f.descriptors[1].key.as_str(),
                f.descriptors[1].value.as_str()
            ),
            ("n", "010")
        );
    }

    /// The reference's decoder gives a text field a plain scalar as written, whatever YAML would type
    /// it as: a rule written `value: 0x1F` matches the request value `0x1F`, not `31`. Number fields
    /// still read the number.
    #[test]
    fn numbers_and_booleans_in_text_fields_are_taken_as_written() {
        let f = parse_file(
            "domain: True
descriptors:
  - {key: hex, value: 0x1F}
  - {key: flag, value: True}
  - {key: phone, value: +441234567890}
  - {key: n, value: 1_000}
  - {key: octal, value: 0o17   }  # a comment
  - {key: zero, value: -0}
  - {key: 0x10, value: FALSE, rate_limit: {unit: minute, requests_per_unit: 0x10, name: 0b101}}
  - key: alias
    value: &spelled 0x2A
  - {key: again, value: *spelled}
  - {key: tagged, value: !!int \"0x1F\"}
",
        )
        .unwrap();
        assert_eq!(f.domain, "True");
        let read: Vec<(&str, &str)> = f
            .descriptors
            .iter()
            .map(|d| (d.key.as_str(), d.value.as_str()))
            .collect();
        assert_eq!(
            read,
            [
                ("hex", "0x1F"),
                ("flag", "True"),
                ("phone", "+441234567890"),
                ("n", "1_000"),
                ("octal", "0o17"),
                ("zero", "-0"),
                ("0x10", "FALSE"),
                ("alias", "0x2A"),
                ("again", "0x2A"),
                ("tagged", "0x1F"),
            ]
        );
        let limit = f.descriptors[6].rate_limit.as_ref().unwrap();
        assert_eq!(
            (limit.requests_per_unit, limit.name.as_str()),
            (16, "0b101")
        );
    }

    /// Flags take the YAML 1.1 spellings of yes and no the reference's decoder reads as booleans.
    #[test]
    fn flags_take_yaml_1_1_booleans() {
        let f = parse_file(
            "domain: d
descriptors:
  - {key: a, shadow_mode: yes, detailed_metric: On, rate_limit: {unlimited: Y}}
  - {key: b, shadow_mode: off, quota_mode: NO, rate_limit: {unit: hour, requests_per_unit: 1, count_over_limit: on}}
",
        )
        .unwrap();
        let (a, b) = (&f.descriptors[0], &f.descriptors[1]);
        assert!(a.flags.shadow_mode && a.flags.detailed_metric);
        assert!(a.rate_limit.as_ref().unwrap().unlimited);
        assert!(!b.flags.shadow_mode && !b.flags.quota_mode);
        assert!(b.rate_limit.as_ref().unwrap().count_over_limit);
        let err = parse_file("domain: d\ndescriptors:\n  - {key: a, shadow_mode: maybe}\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("shadow_mode (expected true or false)"),
            "{err}"
        );
    }

    /// One block shared by many rules through an alias or a merge is how large files are written: any
    /// number of uses loads, within the node budget.
    #[test]
    fn a_block_shared_by_many_rules_loads() {
        let mut text = String::from(
            "domain: d\ndescriptors:\n  - &base {key: k0, shadow_mode: true, rate_limit: &std {unit: minute, requests_per_unit: 100}}\n",
        );
        for i in 1..2_000 {
            text.push_str(&format!("  - {{<<: *base, key: k{i}, rate_limit: *std}}\n"));
        }
        let f = parse_file(&text).unwrap();
        assert_eq!(f.descriptors.len(), 2_000);
        let last = &f.descriptors[1_999];
        assert!(last.flags.shadow_mode);
        assert_eq!(last.rate_limit.as_ref().unwrap().requests_per_unit, 100);
        // Too deep is said in words.
        let mut deep = String::from("domain: d\ndescriptors:\n");
        for depth in 0..40 {
            let pad = "  ".repeat(depth);
            deep.push_str(&format!("{pad}- key: k{depth}\n{pad}  descriptors:\n"));
        }
        let err = parse_file(&deep).unwrap_err().to_string();
        assert!(
            err.ends_with("the file nests maps and lists more than 64 levels deep"),
            "{err}"
        );
        // Written in flow style, too.
        let flow = format!(
            "domain: d\ndescriptors: {}{}\n",
            "[".repeat(70),
            "]".repeat(70)
        );
        let err = parse_file(&flow).unwrap_err().to_string();
        assert!(
            err.ends_with("the file nests maps and lists more than 64 levels deep"),
            "{err}"
        );
    }

    #[test]
    fn fields_where_they_mean_nothing_are_read_as_nothing_and_named() {
        let f = parse_file(
            "domain: d\nkey: stray\ndescriptors:\n  - key: k\n    value: v\n    algorithm: gcra\n    rate_limit: {unit: hour, requests_per_unit: 1, shadow_mode: true, key: x}\n    rate_limits:\n      - {unit: day, requests_per_unit: 5, descriptors: []}\n",
        )
        .unwrap();
        let d = &f.descriptors[0];
        assert!(!d.flags.shadow_mode);
        assert_eq!(d.rate_limit.as_ref().unwrap().algorithm, "");
        assert_eq!(
            f.ignored,
            [
                "'key' at the top of the file is ignored: only domain and descriptors are read there",
                "descriptor 'k: v': 'algorithm' is ignored: a field of rate_limit, not of the descriptor",
                "descriptor 'k: v': 'shadow_mode' in its rate limit is ignored: a field of the descriptor, not of rate_limit",
                "descriptor 'k: v': 'key' in its rate limit is ignored: a field of the descriptor, not of rate_limit",
                "descriptor 'k: v': 'descriptors' in its rate limit is ignored: a field of the descriptor, not of rate_limit",
            ]
        );
        assert!(parse_file("domain: d\ndescriptors:\n  - key: k\n    shadow_mode: true\n    rate_limit: {unit: hour, requests_per_unit: 1}\n")
            .unwrap()
            .ignored
            .is_empty());
        // An empty rate_limit is no limit, and nothing to warn of.
        let f = parse_file("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n").unwrap();
        assert!(
            f.descriptors[0].rate_limit.is_none() && f.ignored.is_empty(),
            "{:?}",
            f.ignored
        );
    }

    /// The reference's decoder reads a key written twice, the last one winning: so does ratelimitd, with
    /// a warning, rather than refuse every rule of the file.
    #[test]
    fn a_key_written_twice_is_read_as_the_last_one() {
        let f = parse_file(
            "domain: first\ndomain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1}\n    rate_limit: {unit: day, requests_per_unit: 7}\n    metadata: {team: a, team: b}\n",
        )
        .unwrap();
        assert_eq!(f.domain, "d");
        let limit = f.descriptors[0].rate_limit.as_ref().unwrap();
        assert_eq!((limit.unit.as_str(), limit.requests_per_unit), ("day", 7));
        assert_eq!(
            f.ignored,
            [
                "'domain' is written twice in one map: the last one is read, as the reference reads it",
                "'rate_limit' is written twice in one map: the last one is read, as the reference reads it",
                "'team' is written twice in one map: the last one is read, as the reference reads it",
            ]
        );
    }

    #[test]
    fn only_the_first_document_counts() {
        let f = parse_file("domain: one\n---\ndomain: two\n").unwrap();
        assert_eq!(f.domain, "one");
        // What follows the first document is never read, faults included, as by the reference.
        for text in [
            "---\ndomain: one\n---\ndomain: [broken\n",
            "# rules\n--- # first\ndomain: one\n...\n%%% not yaml\n",
            "%YAML 1.2\n---\ndomain: one\n--- \n: : :\n",
            "domain: one\r\n---\r\n{{{\r\n",
        ] {
            assert_eq!(parse_file(text).unwrap().domain, "one", "{text:?}");
        }
        // A marker inside a value's text is no marker.
        let f = parse_file("domain: \"a\n  --- b\"\n").unwrap();
        assert_eq!(f.domain, "a --- b");
        assert_eq!(first_document("domain: x\n----\n"), "domain: x\n----\n");
    }

    #[test]
    fn first_pass_errors_use_the_reference_messages() {
        let cases = [
            (
                "domain: d\ndescriptors:\n  - key: a\n    ratelimit: {}\n",
                "config error, unknown key 'ratelimit'",
            ),
            (
                "domain: d\n0.25: x\n",
                "config error, key is not of type string: 0.25",
            ),
            (
                "domain: d\ndescriptors:\n  - just_a_string\n",
                "config error, yaml file contains list of type other than map: just_a_string",
            ),
            (
                "domain: d\ndescriptors:\n  - just_a_string_that_goes_on_for_many_more_words\n",
                "config error, yaml file contains list of type other than map: just_a_string_that_goes_on_for_m... (46 characters)",
            ),
            (
                "domain: d\n[a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, u, v, w, x, y, z]: x\n",
                "config error, key is not of type string: [a b c d e f g h i j k l m n o p... (53 characters)",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    value: 1.5\n",
                "error checking config",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      requestsperunit: 1\n",
                "config error, unknown key 'requestsperunit'",
            ),
        ];
        for (text, want) in cases {
            assert_eq!(parse_file(text).unwrap_err().to_string(), want, "{text}");
        }
    }

    #[test]
    fn syntax_and_type_errors_say_error_loading_config_file() {
        let err = parse_file("domain: d\ndescriptors:\n  - key: [a\n")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("error loading config file: "), "{err}");
        let err = parse_file(
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: -1}\n",
        )
        .unwrap_err().to_string();
        assert!(
            err.starts_with("error loading config file: yaml: unmarshal errors:"),
            "{err}"
        );
        assert!(err.contains("requests_per_unit"), "{err}");
    }

    #[test]
    fn metadata_is_free_form_but_must_be_a_map() {
        let f = parse_file(
            "domain: d\ndescriptors:\n  - key: a\n    metadata: {team: x, nested: {anything_goes: 1.5}}\n",
        )
        .unwrap();
        let m = f.descriptors[0].metadata.as_ref().unwrap();
        assert_eq!(m["team"], "x");
        let err = parse_file("domain: d\ndescriptors:\n  - key: a\n    metadata: [1, 2]\n")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("error parsing metadata: "), "{err}");
    }

    #[test]
    fn the_node_budget_is_a_setting_named_when_a_file_exceeds_it() {
        let mut text = String::from("domain: d\ndescriptors:\n");
        for i in 0..100 {
            text.push_str(&format!(
                "  - key: k\n    value: v{i}\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n"
            ));
        }
        // 5 nodes for the root map, its keys, the domain and the list; 11 per descriptor.
        assert!(parse_file_within(&text, 1_105).is_ok());
        let err = parse_file_within(&text, 1_104).unwrap_err().to_string();
        assert!(
            err.starts_with("error loading config file: yaml: line ")
                && err.ends_with(
                    ": the file has more than 1104 YAML nodes (maps, lists and scalars, aliases expanded); raise rules.max_yaml_nodes to load it"
                ),
            "{err}"
        );
    }

    #[test]
    fn errors_name_the_place_and_the_problem_but_never_quote_the_file() {
        let cases = [
            (
                "domain: d\nsecret: [SECRET\n",
                "line 2 column 9: unclosed bracket '['",
            ),
            ("domain: d\n\tSECRET: x\n", "found a tab"),
            (
                "domain: *SECRET\n",
                "line 1 column 9: alias references unknown anchor",
            ),
            ("domain: !!binary SECRET\n", "line 1 column 18: "),
            (
                "domain: 1e999 # SECRET\n",
                "line 1 column 9: error checking config",
            ),
            ("key: 'SECRET\n", "line 1 column 6: unclosed quote"),
            // A file that is not YAML for rules at all, read as one long scalar.
            (
                "password=SECRET 0123456789abcdef\n",
                "cannot unmarshal `passwor...` into the file (expected a map)",
            ),
            (
                "domain: {domain: SECRET}\n",
                "cannot unmarshal !!map into domain",
            ),
            (
                "domain: d\ndescriptors:\n  - key: a\n    metadata: x-SECRET-SECRET\n",
                "error parsing metadata: expected a map, found `x-SECRE...`",
            ),
        ];
        for (text, want) in cases {
            let err = parse_file(text).unwrap_err().to_string();
            assert!(err.contains(want), "{text:?}: {err}");
            assert!(!err.contains("SECRET"), "{text:?}: {err}");
            assert!(!err.contains('\n'), "one line: {err}");
        }
    }
}
