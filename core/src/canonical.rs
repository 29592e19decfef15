//! JSON text already in canonical form (RFC 8785), recognized in one pass without
//! building a value: a request body sent that way (`JSON.stringify` of a parsed body with
//! sorted keys, most clients' compact output) is fingerprinted as it is, instead of
//! being parsed and written out again (SPEC §8).
//!
//! Conservative: it accepts only text whose canonical form it can prove is the text
//! itself, and says `false` for everything else, which then takes the general path
//! (parse, then [`canonical_json`](crate::canonical_json)). So it never changes a
//! fingerprint: only the time taken to compute it. What it leaves to the general path:
//! any number other than a plain integer of at most 15 digits (and `-0`), object keys
//! with escapes or non-ASCII characters, and text nested deeper than
//! [`CANONICAL_JSON_MAX_DEPTH`](crate::CANONICAL_JSON_MAX_DEPTH).

use crate::key::CANONICAL_JSON_MAX_DEPTH;

/// Whether `text` is JSON in its canonical form (RFC 8785) and within the depth limit.
pub(crate) fn is_canonical(text: &[u8]) -> bool {
    if std::str::from_utf8(text).is_err() {
        return false;
    }
    let mut p = Reader {
        s: text,
        i: 0,
        depth: 0,
    };
    p.value() && p.i == text.len()
}

struct Reader<'a> {
    s: &'a [u8],
    i: usize,
    depth: usize,
}

impl<'a> Reader<'a> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn value(&mut self) -> bool {
        match self.peek() {
            Some(b'{') => self.object(),
            Some(b'[') => self.array(),
            Some(b'"') => self.string().is_some(),
            Some(b't') => self.literal(b"true"),
            Some(b'f') => self.literal(b"false"),
            Some(b'n') => self.literal(b"null"),
            Some(b'-' | b'0'..=b'9') => self.integer(),
            _ => false,
        }
    }

    fn literal(&mut self, word: &[u8]) -> bool {
        let ok = self.s[self.i..].starts_with(word);
        self.i += word.len();
        ok
    }

    /// An opening bracket: false past the depth limit.
    fn open(&mut self) -> bool {
        self.i += 1;
        self.depth += 1;
        self.depth <= CANONICAL_JSON_MAX_DEPTH
    }

    /// A closing bracket.
    fn close(&mut self) -> bool {
        self.i += 1;
        self.depth -= 1;
        true
    }

    fn object(&mut self) -> bool {
        if !self.open() {
            return false;
        }
        if self.peek() == Some(b'}') {
            return self.close();
        }
        let mut last: Option<&[u8]> = None;
        loop {
            // Keys in order of their UTF-16 code units, none repeated: for ASCII keys
            // without escapes that is the order of their bytes.
            if self.peek() != Some(b'"') {
                return false;
            }
            let Some(key) = self.string() else {
                return false;
            };
            if !key.is_ascii() || key.contains(&b'\\') || last.is_some_and(|l| l >= key) {
                return false;
            }
            last = Some(key);
            if self.peek() != Some(b':') {
                return false;
            }
            self.i += 1;
            if !self.value() {
                return false;
            }
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b'}') => return self.close(),
                _ => return false,
            }
        }
    }

    fn array(&mut self) -> bool {
        if !self.open() {
            return false;
        }
        if self.peek() == Some(b']') {
            return self.close();
        }
        loop {
            if !self.value() {
                return false;
            }
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b']') => return self.close(),
                _ => return false,
            }
        }
    }

    /// A string as RFC 8785 writes it (ECMAScript's `JSON.stringify`): `"` and `\`
    /// escaped, control characters as `\b \t \n \f \r` or `\u00xx` (lower-case hex),
    /// everything else as itself. Gives its raw bytes between the quotes. At a `"`.
    fn string(&mut self) -> Option<&'a [u8]> {
        let s = self.s;
        let start = self.i + 1;
        let mut i = start;
        loop {
            match *s.get(i)? {
                b'"' => {
                    self.i = i + 1;
                    return Some(&s[start..i]);
                }
                b'\\' => {
                    match *s.get(i + 1)? {
                        b'"' | b'\\' | b'b' | b'f' | b'n' | b'r' | b't' => i += 2,
                        b'u' => {
                            let hex = s.get(i + 2..i + 6)?;
                            let c = match (hex[0], hex[1], hex[2], hex[3]) {
                                (b'0', b'0', h @ (b'0' | b'1'), l) => {
                                    let l = match l {
                                        b'0'..=b'9' => l - b'0',
                                        b'a'..=b'f' => l - b'a' + 10,
                                        _ => return None,
                                    };
                                    (h - b'0') * 16 + l
                                }
                                _ => return None,
                            };
                            // Those with a short form are written with it.
                            if matches!(c, 0x08 | 0x09 | 0x0a | 0x0c | 0x0d) {
                                return None;
                            }
                            i += 6;
                        }
                        _ => return None,
                    }
                }
                0x00..=0x1f => return None,
                _ => i += 1,
            }
        }
    }

    /// A plain integer of at most 15 digits (exact as a double, written as itself);
    /// `-0` is written `0`.
    fn integer(&mut self) -> bool {
        let s = self.s;
        let neg = s[self.i] == b'-';
        let start = self.i + usize::from(neg);
        let mut i = start;
        while s.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        let digits = &s[start..i];
        self.i = i;
        let plain = match digits {
            [] => false,
            [b'0'] => !neg,
            [b'0', ..] => false,
            _ => digits.len() <= 15,
        };
        plain && !matches!(self.peek(), Some(b'.' | b'e' | b'E'))
    }
}

#[cfg(test)]
mod tests {
    use super::is_canonical;

    /// The general path's canonical bytes of `text`, if it parses.
    fn canonical(text: &[u8]) -> Option<Vec<u8>> {
        let v: serde_json::Value = serde_json::from_slice(text).ok()?;
        crate::canonical_json(&v).ok()
    }

    #[test]
    fn accepts_canonical_text() {
        for t in [
            r#"{"sku":"A1"}"#,
            r#"{"a":1,"b":[true,false,null],"c":{"d":-12,"e":"x\"y\\z"}}"#,
            r#"[]"#,
            r#"{}"#,
            r#""\u001f\b\t\n\f\r\u0000""#,
            r#"{"name":"Zoë ☃ 𝄞","qty":0}"#,
            "123456789012345",
            "-7",
        ] {
            assert!(is_canonical(t.as_bytes()), "{t}");
            assert_eq!(
                canonical(t.as_bytes()).as_deref(),
                Some(t.as_bytes()),
                "{t}"
            );
        }
    }

    #[test]
    fn refuses_what_it_cannot_prove() {
        for t in [
            r#"{"b":1,"a":2}"#, // key order
            r#"{"a":1,"a":2}"#, // a repeated key
            r#"{ "a":1}"#,      // whitespace
            r#"{"a":1} "#,      // trailing whitespace
            r#"{"a":1.5}"#,     // a fraction
            r#"{"a":1e3}"#,     // an exponent
            "1234567890123456", // 16 digits
            "-0",               // written 0
            "01",               // a leading zero
            r#""\/""#,          // an escape JCS does not write
            r#""\u0041""#,      // an escaped letter
            r#""\u000a""#,      // \n has a short form
            r#""\u001F""#,      // upper-case hex
            "\"\u{1}\"",        // an unescaped control character
            r#"{"é":1}"#,       // a non-ASCII key (UTF-16 order)
            r#"{"a\"":1}"#,     // an escaped key
            r#"{"a":1"#,        // unterminated
            r#"[1,]"#,          // a trailing comma
            r#"{1:2}"#,         // a key that is not a string
            "tru",              // a cut literal
            "",                 // nothing
        ] {
            assert!(!is_canonical(t.as_bytes()), "{t}");
        }
        assert!(!is_canonical(b"\"\xff\""), "invalid UTF-8");
    }

    #[test]
    fn the_depth_limit_is_the_general_paths() {
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        let at = deep(crate::CANONICAL_JSON_MAX_DEPTH);
        assert!(is_canonical(at.as_bytes()));
        assert_eq!(canonical(at.as_bytes()).as_deref(), Some(at.as_bytes()));
        let over = deep(crate::CANONICAL_JSON_MAX_DEPTH + 1);
        assert!(!is_canonical(over.as_bytes()));
    }

    #[test]
    fn every_control_character_in_its_one_canonical_form() {
        for c in 0u8..0x20 {
            let escaped = match c {
                0x08 => r"\b".to_string(),
                0x09 => r"\t".to_string(),
                0x0a => r"\n".to_string(),
                0x0c => r"\f".to_string(),
                0x0d => r"\r".to_string(),
                _ => format!(r"\u{c:04x}"),
            };
            let t = format!("\"{escaped}\"");
            assert!(is_canonical(t.as_bytes()), "{t}");
            assert_eq!(
                canonical(t.as_bytes()).as_deref(),
                Some(t.as_bytes()),
                "{t}"
            );
            let other = format!(r#""\u{c:04X}""#);
            if other != t {
                assert!(!is_canonical(other.as_bytes()), "{other}");
            }
        }
    }

    mod properties {
        use super::{canonical, is_canonical};
        use proptest::prelude::*;
        use serde_json::{Map, Number, Value};

        fn key() -> impl Strategy<Value = String> {
            prop_oneof![4 => "[a-z_]{0,6}", 1 => "[a-zA-Z0-9 é☃\\\"\u{1}-\u{1f}\u{10000}]{0,4}"]
        }

        fn leaf() -> impl Strategy<Value = Value> {
            prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::Bool),
                (-999_999_999_999_999i64..=999_999_999_999_999).prop_map(Value::from),
                any::<i64>().prop_map(Value::from),
                any::<f64>()
                    .prop_filter("finite", |f| f.is_finite())
                    .prop_map(|f| Value::Number(Number::from_f64(f).unwrap())),
                "[ -~é☃\\\"\u{0}-\u{1f}\u{7f}\u{2028}\u{10000}]{0,8}".prop_map(Value::String),
            ]
        }

        fn value() -> impl Strategy<Value = Value> {
            leaf().prop_recursive(4, 32, 5, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                    prop::collection::vec((key(), inner), 0..5)
                        .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
                ]
            })
        }

        proptest! {
            /// Accepted text is exactly its own canonical form, and the canonical form of
            /// a value is accepted unless it holds what the reader leaves to the general path.
            #[test]
            fn accepted_text_is_its_own_canonical_form(v in value()) {
                let c = crate::canonical_json(&v).unwrap();
                if is_canonical(&c) {
                    prop_assert_eq!(canonical(&c), Some(c.clone()));
                }
                let plain = |v: &Value| -> bool {
                    fn walk(v: &Value) -> bool {
                        match v {
                            Value::Number(n) => n.as_i64().is_some_and(|i| i.unsigned_abs() < 1_000_000_000_000_000 && (i != 0 || !n.to_string().starts_with('-'))) ,
                            Value::Array(a) => a.iter().all(walk),
                            Value::Object(o) => o.iter().all(|(k, v)| k.is_ascii() && !k.contains(['"', '\\']) && !k.chars().any(|c| c < ' ') && walk(v)),
                            _ => true,
                        }
                    }
                    walk(v)
                };
                if plain(&v) {
                    prop_assert!(is_canonical(&c), "not accepted: {}", String::from_utf8_lossy(&c));
                }
            }

            /// Whatever the text, what is accepted is its own canonical form.
            #[test]
            fn any_accepted_text_is_canonical(v in value(), cut in any::<prop::sample::Index>(), byte in any::<u8>(), edit in 0u8..3) {
                let mut t = serde_json::to_vec(&v).unwrap();
                if !t.is_empty() {
                    let i = cut.index(t.len());
                    match edit {
                        0 => t[i] = byte,
                        1 => { t.insert(i, byte); }
                        _ => { t.remove(i); }
                    }
                }
                if is_canonical(&t) {
                    prop_assert_eq!(canonical(&t), Some(t.clone()), "{}", String::from_utf8_lossy(&t));
                }
            }
        }
    }
}
