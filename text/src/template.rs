//! The chat template, rendered with minijinja set up the way `transformers` sets up Jinja2
//! (vLLM renders through it): `trim_blocks`, `lstrip_blocks`, loop controls, Python string
//! methods, `raise_exception`, and a `tojson` that writes what Python's `json.dumps` writes.

use std::panic::{catch_unwind, AssertUnwindSafe};

use minijinja::value::Kwargs;
use minijinja::{Environment, ErrorKind, Value};
use serde::Serialize;

use crate::error::TextError;
use crate::message::Message;

const NAME: &str = "chat";

/// Template instructions allowed per render: bounds a hostile message list's cost. A render of
/// 2,048 messages through the Qwen3 template takes well under a tenth of this.
const FUEL: u64 = 50_000_000;

/// A compiled chat template.
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
}

/// The special tokens `transformers` passes to every render.
#[derive(Debug, Default, Clone)]
pub(crate) struct SpecialTokens {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub unk_token: Option<String>,
    pub pad_token: Option<String>,
}

impl ChatTemplate {
    /// Compiles `source`; an error names what the template engine refused.
    pub(crate) fn compile(source: String) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source)
            .map_err(|e| e.to_string())?;
        Ok(ChatTemplate { env })
    }

    /// Renders `messages`.
    pub(crate) fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        special: &SpecialTokens,
    ) -> Result<String, TextError> {
        let messages: Vec<Value> = messages.iter().map(message_value).collect();
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => special.bos_token.clone().unwrap_or_default(),
            eos_token => special.eos_token.clone().unwrap_or_default(),
            unk_token => special.unk_token.clone(),
            pad_token => special.pad_token.clone(),
        };
        // minijinja returns errors rather than panicking; the guard is for what it does not
        // foresee, so a template can never take the process down.
        let rendered = catch_unwind(AssertUnwindSafe(|| {
            let template = self.env.get_template(NAME)?;
            template.render(ctx)
        }));
        match rendered {
            Ok(Ok(text)) => Ok(text),
            Ok(Err(e)) => Err(TextError::Template(describe(&e))),
            Err(_) => Err(TextError::Template("the template engine panicked".into())),
        }
    }
}

fn message_value(m: &Message) -> Value {
    let mut map: serde_json::Map<String, serde_json::Value> = m.extra.clone();
    map.insert("role".into(), m.role.clone().into());
    map.insert("content".into(), m.content.clone().into());
    Value::from_serialize(&map)
}

/// The error with its cause chain (minijinja puts the template's own message in the detail).
fn describe(e: &minijinja::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// `tojson` as `transformers` defines it: `json.dumps(x, ensure_ascii=False, indent=...)`, so
/// separators are `", "` and `": "` without indent (minijinja's own escapes HTML characters,
/// which would change the rendered prompt).
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let fmt = serde_json::ser::PrettyFormatter::with_indent(&pad);
            json.serialize(&mut serde_json::Serializer::with_formatter(&mut out, fmt))
        }
        None => json.serialize(&mut serde_json::Serializer::with_formatter(
            &mut out,
            PythonFormatter,
        )),
    };
    written
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from_safe_string(
        String::from_utf8_lossy(&out).into_owned(),
    ))
}

/// Python's default `json.dumps` separators.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, messages: &[Message]) -> Result<String, TextError> {
        ChatTemplate::compile(src.into())
            .unwrap()
            .render(messages, true, &SpecialTokens::default())
    }

    #[test]
    fn raise_exception_is_a_template_error_with_its_message() {
        let err = render("{{ raise_exception('only user turns') }}", &[]).unwrap_err();
        assert!(
            matches!(&err, TextError::Template(m) if m.contains("only user turns")),
            "{err}"
        );
    }

    #[test]
    fn tojson_writes_python_separators_without_html_escapes() {
        let mut m = Message::new("user", "x");
        m.extra
            .insert("args".into(), serde_json::json!({"a": [1, "<b>"]}));
        let out = render("{{ messages[0].args | tojson }}", &[m]).unwrap();
        assert_eq!(out, r#"{"a": [1, "<b>"]}"#);
    }

    #[test]
    fn runaway_templates_run_out_of_fuel() {
        let err = render(
            "{% for i in range(10000) %}{% for j in range(10000) %}x{% endfor %}{% endfor %}",
            &[],
        )
        .unwrap_err();
        assert_eq!(err.kind(), "template");
    }
}
