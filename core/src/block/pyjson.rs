//! JSON text exactly as Python's `json.dumps` renders it.
//!
//! oMLX stores several metadata values as `json.dumps(...)` output and writes the safetensors
//! header with `json.dumps(header, separators=(",", ":"))`. A block written from Rust must carry
//! the same bytes, so this renders with Python's rules: ASCII-only output (`\uXXXX` escapes,
//! surrogate pairs above the BMP), Python's separators, insertion order unless sorted.

/// A JSON value with ordered object keys.
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    Int(i64),
    Str(String),
    List(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

/// `json.dumps` options that matter here.
#[derive(Clone, Copy, Debug)]
pub struct Style {
    pub item_sep: &'static str,
    pub key_sep: &'static str,
    pub sort_keys: bool,
}

/// `json.dumps(x)`.
pub const DEFAULT: Style = Style { item_sep: ", ", key_sep: ": ", sort_keys: false };
/// `json.dumps(x, separators=(",", ":"))`.
pub const COMPACT: Style = Style { item_sep: ",", key_sep: ":", sort_keys: false };
/// `json.dumps(x, sort_keys=True, separators=(",", ":"))`.
pub const COMPACT_SORTED: Style = Style { item_sep: ",", key_sep: ":", sort_keys: true };

impl Json {
    pub fn str(s: impl Into<String>) -> Json {
        Json::Str(s.into())
    }

    pub fn dumps(&self, style: Style) -> String {
        let mut out = String::new();
        self.write(&mut out, style);
        out
    }

    fn write(&self, out: &mut String, style: Style) {
        match self {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Int(i) => out.push_str(&i.to_string()),
            Json::Str(s) => write_str(out, s),
            Json::List(items) => {
                out.push('[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(style.item_sep);
                    }
                    v.write(out, style);
                }
                out.push(']');
            }
            Json::Obj(entries) => {
                let mut refs: Vec<&(String, Json)> = entries.iter().collect();
                if style.sort_keys {
                    // Python sorts str keys by code point; UTF-16 order differs only for
                    // astral characters, which keys here never contain.
                    refs.sort_by(|a, b| a.0.cmp(&b.0));
                }
                out.push('{');
                for (i, (k, v)) in refs.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(style.item_sep);
                    }
                    write_str(out, k);
                    out.push_str(style.key_sep);
                    v.write(out, style);
                }
                out.push('}');
            }
        }
    }
}

fn write_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_python_rendering() {
        // Expected strings produced by CPython's json.dumps.
        let v = Json::Obj(vec![
            ("b".into(), Json::List(vec![Json::Int(1), Json::str("x")])),
            ("a".into(), Json::str("é\"\\\n\u{1}𝄞")),
        ]);
        assert_eq!(v.dumps(DEFAULT), r#"{"b": [1, "x"], "a": "\u00e9\"\\\n\u0001\ud834\udd1e"}"#);
        assert_eq!(v.dumps(COMPACT), r#"{"b":[1,"x"],"a":"\u00e9\"\\\n\u0001\ud834\udd1e"}"#);
        assert_eq!(v.dumps(COMPACT_SORTED), r#"{"a":"\u00e9\"\\\n\u0001\ud834\udd1e","b":[1,"x"]}"#);
        assert_eq!(Json::str("\u{7f}").dumps(DEFAULT), r#""\u007f""#);
    }
}
