//! The rules: the reference YAML format, validated and compiled into an immutable [`RuleSet`] that
//! requests are matched against. The current set lives in [`Rules`] and is swapped whole.
//!
//! # Layout
//! A load runs down this list; each module uses only those below it.
//! - `watcher`: reloads when the rules folder changes; its [`Publisher`] swaps in every loaded set, from
//!   the files or from a control plane (`api::xds` builds those from [`DomainFile`]s of its own).
//! - `loader`: reads a rules folder, all files or none.
//! - `compile`: parsed files to a [`RuleSet`], with the semantic checks.
//! - `yaml`: one file's text to a [`DomainFile`], with the key and type checks; `yaml_tree` is the
//!   generic YAML tree it reads first.
//! - `error`: the errors of the three above, with the messages operators see.
//! - `matcher` and `rlconfig`: what requests and `/rlconfig` read from a built [`RuleSet`].
//! - `model`: the compiled tree itself ([`RuleSet`], [`Node`], [`Limit`]).
//! - `flags`, `pattern`, `unit`: a rule's yes/no settings, its `cidr:` and `*` values, its units.
//! - `options`: where the rules live ([`RulesSettings`], part of the process settings) and the
//!   [`Source`] a load and the watcher work from.

mod compile;
mod error;
mod flags;
mod loader;
mod matcher;
mod model;
mod options;
mod pattern;
mod reach;
mod rlconfig;
mod unit;
mod watcher;
mod yaml;
mod yaml_tree;

use std::sync::Arc;

use arc_swap::ArcSwapOption;

pub use compile::compile_runtime_limit;
pub use error::{
    BuildError, LimitField, LoadError, Location, ParseError, RuleError, RulePlace, SyntaxProblem,
};
pub use flags::RuleFlags;
pub use loader::{load, Fingerprint, Loaded};
pub use matcher::EntryRef;
pub use model::{
    written_key, Domain, KeyNodes, Level, Limit, Node, Path, PathStep, RuleMap, RulePath, RuleSet,
    MAX_WINDOW_SECS,
};
pub use options::{ConfigType, RulesSettings, Source, DEFAULT_MAX_YAML_NODES};
pub use pattern::{Cidr, CidrError, Wildcard};
pub use reach::EntryBounds;
pub use unit::Unit;
pub use watcher::{reload, OnLoaded, Publisher, ReloadStats, RulesWatch};
pub use yaml::{parse_file, parse_file_within, DescriptorSpec, DomainFile, RateLimitSpec};

/// The rule set requests are decided against; empty until the first successful load.
#[derive(Debug, Default)]
pub struct Rules {
    current: ArcSwapOption<RuleSet>,
}

impl Rules {
    /// The current snapshot, if any rules were ever loaded.
    pub fn snapshot(&self) -> Option<Arc<RuleSet>> {
        self.current.load_full()
    }

    /// The current snapshot, borrowed: no reference count is taken while few are borrowed at once on
    /// a thread (see [`arc_swap::Guard`]), so deciding a request leaves the snapshot's count alone.
    pub fn current(&self) -> arc_swap::Guard<Option<Arc<RuleSet>>> {
        self.current.load()
    }

    /// Replaces the current snapshot.
    pub fn replace(&self, rules: RuleSet) {
        self.current.store(Some(Arc::new(rules)));
    }
}
