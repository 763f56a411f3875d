//! Where a request's values come from: token ids, model, tenant and cache salt, each from the
//! first of its configured sources (header, metadata, body field) that has it. A body source
//! keeps a value pending until the body is scanned.

use std::borrow::Cow;

use kvroute::intake::{self, Found};

use super::{BodyCtx, Http, Res, Tok};
use crate::config::{Config, Source, Sources};
use crate::host;
use crate::outcome::Outcome;
use crate::vm::Scratch;

/// Most tokens taken from one header or metadata value.
const MAX_STRING_TOKENS: usize = 1 << 20;

impl Http {
    fn resolve_str(
        &self,
        sources: &Sources,
        from: usize,
        body: Option<&BodyCtx<'_>>,
        cfg: &Config,
    ) -> Res<String> {
        for (i, src) in sources.sources.iter().enumerate().skip(from) {
            let value = match src {
                Source::Header(name) => self
                    .request_header(name)
                    .and_then(|v| String::from_utf8(v.into_owned()).ok()),
                Source::Metadata(path) => {
                    host::get_property(path).and_then(|v| String::from_utf8(v).ok())
                }
                Source::Body(field) => match body {
                    None if self.body_possible => return Res::Pending(i),
                    None => None,
                    Some(b) => match cfg.body_field(field).and_then(|fi| b.found.get(fi)) {
                        Some(Found::Str {
                            start,
                            end,
                            escaped,
                        }) => {
                            let raw = b.bytes.get(*start..*end).unwrap_or_default();
                            if *escaped {
                                intake::unescape(raw)
                            } else {
                                std::str::from_utf8(raw).ok().map(str::to_owned)
                            }
                        }
                        _ => None,
                    },
                },
            };
            if let Some(v) = value.filter(|v| !v.is_empty()) {
                return Res::Done(Some(v));
            }
        }
        Res::Done(sources.default.clone())
    }

    fn resolve_tokens(
        &self,
        sources: &Sources,
        from: usize,
        body: Option<&BodyCtx<'_>>,
        cfg: &Config,
        scratch: &mut Scratch,
    ) -> Result<Res<Tok>, Outcome> {
        for (i, src) in sources.sources.iter().enumerate().skip(from) {
            let value = match src {
                Source::Header(name) => self.request_header(name),
                Source::Metadata(path) => host::get_property(path).map(Cow::Owned),
                Source::Body(field) => {
                    match body {
                        None if self.body_possible => return Ok(Res::Pending(i)),
                        None => {}
                        Some(b) => {
                            if let Some(Found::Tokens { start, end }) =
                                cfg.body_field(field).and_then(|fi| b.found.get(fi))
                            {
                                return Ok(Res::Done(Some(Tok::Body(*start, *end))));
                            }
                        }
                    }
                    continue;
                }
            };
            let Some(v) = value.filter(|v| !v.is_empty()) else {
                continue;
            };
            return match intake::parse_token_string(&v, &mut scratch.str_tokens, MAX_STRING_TOKENS)
            {
                Ok(()) => Ok(Res::Done(Some(Tok::Str))),
                Err(e) => {
                    log::debug!("kvroute[{}]: bad token value: {e}", self.id);
                    Err(Outcome::BadHeader)
                }
            };
        }
        Ok(Res::Done(None))
    }

    /// Moves every value's resolution on; `Err` ends the request with that outcome.
    pub(super) fn resolve(
        &mut self,
        body: Option<&BodyCtx<'_>>,
        cfg: &Config,
        scratch: &mut Scratch,
    ) -> Result<bool, Outcome> {
        if let Res::Pending(i) = self.tokens {
            self.tokens = self.resolve_tokens(&cfg.tokens, i, body, cfg, scratch)?;
        }
        if let Res::Pending(i) = self.model {
            self.model = self.resolve_str(&cfg.model, i, body, cfg);
        }
        if let Res::Pending(i) = self.tenant {
            self.tenant = self.resolve_str(&cfg.tenant, i, body, cfg);
        }
        if let Res::Pending(i) = self.salt {
            self.salt = self.resolve_str(&cfg.cache_salt, i, body, cfg);
        }
        let pending = [
            matches!(self.tokens, Res::Pending(_)),
            matches!(self.model, Res::Pending(_)),
            matches!(self.tenant, Res::Pending(_)),
            matches!(self.salt, Res::Pending(_)),
        ];
        Ok(pending.iter().any(|p| *p))
    }
}
