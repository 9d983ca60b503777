//! The rules: the reference YAML format, validated and compiled into an immutable [`RuleSet`] that
//! requests are matched against. The current set lives in [`Rules`] and is swapped whole.

mod compile;
mod error;
mod flags;
mod loader;
mod matcher;
mod model;
mod pattern;
mod rlconfig;
mod unit;
mod watcher;
mod yaml;

use std::sync::Arc;

use arc_swap::ArcSwapOption;

pub use error::{
    BuildError, CidrError, LimitField, LoadError, Location, ParseError, RuleError, SyntaxProblem,
};
pub use flags::RuleFlags;
pub use loader::{load, Loaded};
pub use matcher::EntryRef;
pub use model::{Domain, KeyNodes, Level, Limit, Node, PathStep, RuleSet};
pub use pattern::{Cidr, Wildcard};
pub use unit::Unit;
pub use watcher::{reload, OnLoaded, ReloadStats, RulesWatch};
pub use yaml::{parse_file, parse_file_within, DomainFile};

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

    /// Replaces the current snapshot.
    pub fn replace(&self, rules: RuleSet) {
        self.current.store(Some(Arc::new(rules)));
    }
}
