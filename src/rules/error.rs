//! Every way loading rules can fail, one enum per stage: reading a file's YAML ([`ParseError`]),
//! compiling a file's rules ([`RuleError`], named by file in [`BuildError`]), reading the folder
//! ([`LoadError`]). A malformed `cidr:` value's reason is the pattern's own [`CidrError`].
//!
//! The texts are the reference service's messages where it has one, since operators grep for them;
//! ratelimitd's own checks name the rule and the field to fix. No message quotes a file beyond a short
//! scalar, so a file read by mistake never reaches a log line.

use std::{fmt, io};

use super::{
    model::{MAX_WINDOW_SECS, SLIDING_LOG_MAX_LIMIT},
    pattern::CidrError,
    unit::Unit,
};
use crate::algorithm::Algorithm;

/// Why the text of one rules file is not a rules file.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ParseError {
    /// The YAML parser refused the text.
    #[error("error loading config file: yaml: {at}{problem}")]
    Syntax {
        at: Location,
        problem: SyntaxProblem,
    },
    #[error("config error, key is not of type string: {0}")]
    KeyNotString(String),
    #[error("config error, unknown key '{0}'")]
    UnknownKey(String),
    #[error("config error, yaml file contains list of type other than map: {0}")]
    ListItemNotMap(String),
    /// A float, or an integer above `i64::MAX`, outside `metadata`.
    #[error("error checking config")]
    UnsupportedNumber,
    /// A value of the wrong type; `found` is shortened (see `Yaml::brief`).
    #[error("error loading config file: yaml: unmarshal errors: cannot unmarshal {found} into {field} (expected {expected})")]
    WrongType {
        found: String,
        field: String,
        expected: &'static str,
    },
    #[error("error parsing metadata: expected a map, found {0}")]
    MetadataNotMap(String),
    #[error("error parsing metadata: key {0} is not a string")]
    MetadataKeyNotString(String),
    #[error("error parsing metadata: {0} is not a finite number")]
    MetadataNotFinite(f64),
    /// Another error, and the line of the map (a descriptor, a rate limit) it is in. Written as the
    /// error alone: the reference's messages stay as they are, and the line is told beside them
    /// ([`LoadError::place`]).
    #[error("{error}")]
    InMapAt { line: u32, error: Box<ParseError> },
}

impl ParseError {
    /// The error, placed in the map starting at `line` unless it is placed already (in a map within)
    /// or the line is not known (0).
    pub fn at_line(self, line: u32) -> ParseError {
        match self {
            placed @ ParseError::InMapAt { .. } => placed,
            error if line == 0 => error,
            error => ParseError::InMapAt {
                line,
                error: Box::new(error),
            },
        }
    }

    /// The line of the map the error is in, when known.
    pub fn line(&self) -> Option<u32> {
        match self {
            ParseError::InMapAt { line, .. } => Some(*line),
            ParseError::Syntax { at, .. } => at
                .line_column
                .and_then(|(line, _)| u32::try_from(line).ok()),
            _ => None,
        }
    }
}

/// Where in a file the YAML parser stopped, when it says; written `line L column C: ` in front of the
/// problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Location {
    pub line_column: Option<(u64, u64)>,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line_column {
            Some((line, column)) => write!(f, "line {line} column {column}: "),
            None => Ok(()),
        }
    }
}

/// What the YAML parser found wrong, in words that never quote the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SyntaxProblem {
    #[error("the file has more than {0} YAML nodes (maps, lists and scalars, aliases expanded); raise rules.max_yaml_nodes to load it")]
    TooManyNodes(usize),
    #[error("the file nests maps and lists more than {0} levels deep")]
    TooDeep(usize),
    #[error("a key appears twice in one map")]
    DuplicateKey,
    #[error("error checking config")]
    NotFinite,
    /// The parser's own words, for the errors known not to quote the file.
    #[error("{0}")]
    Described(String),
    #[error("not a valid rules file")]
    NotRules,
}

/// Why a parsed rules file does not compile.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    #[error("config file cannot have empty domain")]
    EmptyDomain,
    /// The reference's words, then the file that declared the domain first, and a hint when either is
    /// a Kubernetes volume's hidden copy (`..2026_...`, `..data`).
    #[error("duplicate domain '{domain}' in config file (first declared in {first}){hint}")]
    DuplicateDomain {
        domain: String,
        first: String,
        hint: &'static str,
    },
    #[error("descriptor has empty key")]
    EmptyKey,
    /// Holds the rule's `domain.key_value...` name.
    #[error("duplicate descriptor composite key '{0}'")]
    DuplicateKey(String),
    #[error("invalid rate limit unit '{0}'")]
    InvalidUnit(String),
    #[error("should not specify rate limit unit when unlimited")]
    UnitWhenUnlimited,
    #[error("should not have an empty replaces entry")]
    EmptyReplaces,
    #[error("replaces should not contain name of same descriptor")]
    ReplacesItself,
    /// Holds the node's composite key (`key_value`).
    #[error("share_threshold can only be used with wildcard values (containing '*'), but found key '{0}'")]
    ShareThresholdWithoutWildcard(String),
    #[error("rule '{rule}': value: malformed CIDR '{value}': {source}")]
    MalformedCidr {
        rule: String,
        value: String,
        source: CidrError,
    },
    #[error("rule '{rule}': {field}.algorithm: unknown algorithm '{name}'; use one of {}", Algorithm::NAMES.join(", "))]
    UnknownAlgorithm {
        rule: String,
        field: LimitField,
        name: String,
    },
    #[error("rule '{rule}': {field}.burst: burst means nothing for {}; it sets the capacity of token_bucket and gcra", .algorithm.name())]
    BurstWithoutBucket {
        rule: String,
        field: LimitField,
        algorithm: Algorithm,
    },
    #[error("rule '{rule}': {field}.unit_multiplier: must be a whole number of at least 1, not {written}")]
    UnitMultiplier {
        rule: String,
        field: LimitField,
        written: i64,
    },
    #[error("rule '{rule}': {field}.requests_per_unit: a sliding_log keeps one entry per counted request; use at most {SLIDING_LOG_MAX_LIMIT}, or sliding_window")]
    SlidingLogTooLarge { rule: String, field: LimitField },
    #[error("rule '{rule}': {field}.count_over_limit: an unlimited limit counts nothing")]
    CountOverUnlimited { rule: String, field: LimitField },
    #[error("rule '{rule}': {field}: unlimited belongs in rate_limit, not in rate_limits")]
    UnlimitedInRateLimits { rule: String, field: LimitField },
    #[error("rule '{rule}': {field}.unit_multiplier: a window of {unit_multiplier} x {unit} ({window_secs} seconds) is longer than the longest a limit may have, 10 years ({MAX_WINDOW_SECS} seconds)")]
    WindowTooLong {
        rule: String,
        field: LimitField,
        unit_multiplier: u32,
        unit: Unit,
        window_secs: u64,
    },
    #[error("rule '{rule}': {field}.burst: refilling a burst of {burst} at {per_window} per {window_secs} seconds takes longer than the longest a limit may take to reset, 10 years ({MAX_WINDOW_SECS} seconds); lower burst or the window, or raise requests_per_unit")]
    RefillTooLong {
        rule: String,
        field: LimitField,
        burst: u64,
        per_window: u64,
        window_secs: u64,
    },
}

/// Which limit of a rule an error is about, as the file writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitField {
    /// `rate_limit`.
    RateLimit,
    /// The entry of `rate_limits` at this index.
    RateLimits(usize),
}

impl fmt::Display for LimitField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LimitField::RateLimit => f.write_str("rate_limit"),
            LimitField::RateLimits(i) => write!(f, "rate_limits[{i}]"),
        }
    }
}

/// A rules file that does not compile, by name, and the rule at fault when the error is about one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}: {error}")]
pub struct BuildError {
    pub file: String,
    #[source]
    pub error: RuleError,
    pub rule: Option<Box<RulePlace>>,
}

/// The rule an error is about: its name, and the line it starts on in its file (0: not from a file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RulePlace {
    /// `domain.key_value...`, as `/rlconfig` names it.
    pub name: String,
    pub line: u32,
}

/// Why a rules folder could not be loaded. Every message starts with the file (or the folder) at fault.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The rules folder is not there (at start, an empty rule set: see [`crate::rules::reload`]).
    #[error("{root}: the rules folder does not exist")]
    Missing { root: String },
    #[error("{root}: the rules folder is not a folder")]
    NotAFolder { root: String },
    /// A folder (the root, or one under it) that could not be read, by its path.
    #[error("{folder}: {source}")]
    Walk { folder: String, source: io::Error },
    #[error("{file}: points outside the rules folder")]
    Outside { file: String },
    #[error("{file}: a link that cannot be followed: {reason}")]
    Unresolved { file: String, reason: String },
    #[error("{file}: cannot read file: {source}")]
    Read { file: String, source: io::Error },
    #[error("{file}: error loading config file: neither UTF-8 text nor UTF-16 text starting with a byte order mark")]
    NotUtf8 { file: String },
    #[error("{file}: {source}")]
    Parse { file: String, source: ParseError },
    #[error(transparent)]
    Build(#[from] BuildError),
}

impl LoadError {
    /// Where the error is, when the message does not say (the reference's messages name neither a
    /// line nor, mostly, the rule): `web.yaml: the rule starting at line 12 ('web.path_/a')`.
    pub fn place(&self) -> Option<String> {
        match self {
            LoadError::Parse { file, source } => match source {
                // A syntax error's message has its line.
                ParseError::Syntax { .. } => None,
                other => other
                    .line()
                    .map(|line| format!("{file}: the map starting at line {line}")),
            },
            LoadError::Build(BuildError {
                file,
                rule: Some(rule),
                ..
            }) => Some(match rule.line {
                0 => format!("{file}: the rule '{}'", rule.name),
                line => format!("{file}: the rule starting at line {line} ('{}')", rule.name),
            }),
            _ => None,
        }
    }
}
