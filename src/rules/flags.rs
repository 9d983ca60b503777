//! The yes/no settings of a rule (`shadow_mode: true`, ...), declared once: the YAML reader takes its
//! list of accepted keys and its decoding from here, and the compiled tree keeps the same struct.

/// Declares [`RuleFlags`]: one `bool` field per flag, named as the rules file writes it.
macro_rules! rule_flags {
    ($($(#[doc = $doc:literal])* $name:ident,)*) => {
        /// The yes/no settings of one descriptor node; all default to `false`.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
        pub struct RuleFlags {
            $($(#[doc = $doc])* pub $name: bool,)*
        }

        impl RuleFlags {
            /// The flags' names, as rules files write them.
            pub const KEYS: &'static [&'static str] = &[$(stringify!($name),)*];

            /// The flag a rules file key names, if it names one.
            pub fn by_key(&mut self, key: &str) -> Option<&mut bool> {
                match key {
                    $(stringify!($name) => Some(&mut self.$name),)*
                    _ => None,
                }
            }
        }
    };
}

rule_flags! {
    /// Over-limit answers of this rule are turned into OK (the counting still happens).
    shadow_mode,
    /// The rule takes part in the quota-mode overall decision (see the limiter).
    quota_mode,
    /// The rule's metrics are labelled with the request's values rather than the rule's.
    detailed_metric,
    /// A wildcard or key-only level of the rule is labelled in metrics with the request's value.
    value_to_metric,
    /// The node's wildcard (or network) shares one counter across all values it matches.
    share_threshold,
    /// The request's value at this node's level is sensitive: counted and shown only as a keyed hash.
    hash_value,
}
