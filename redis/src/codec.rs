//! The result codec: how a result is laid out in a record's `result` field so that
//! every language can read what another one stored (README, "Result encoding").
//!
//! A stored result is one **tag byte** and a body:
//!
//! | tag | body | meaning |
//! |-----|------|---------|
//! | `j` | UTF-8 JSON text | a JSON value |
//! | `b` | raw bytes | a byte string |
//! | `n` | empty | completed with no value (`None`, `undefined`) |
//! | `x` | UTF-8 type name | completed, but the result could not be stored |
//! | `u` | raw bytes | the output of the store's user codec (bytes) |
//! | `t` | UTF-8 text | the output of the store's user codec (text) |
//!
//! Rust callers of [`RedisStore`](crate::RedisStore) may store any bytes; the Python
//! and Node stores always go through this module, and turn JSON text and bytes into
//! their native values themselves.
//!
//! ```
//! use oncely_redis::codec::{decode, StoredResult};
//!
//! let record = StoredResult::Json("{\"id\":7}").encode();
//! assert_eq!(record, b"j{\"id\":7}");
//! assert_eq!(decode(&record).unwrap(), StoredResult::Json("{\"id\":7}"));
//! assert_eq!(decode(b"n").unwrap(), StoredResult::NoValue);
//! ```

use oncely::{Error, ScopedKey};

/// Tag of a JSON value.
pub const TAG_JSON: u8 = b'j';
/// Tag of a byte string.
pub const TAG_BYTES: u8 = b'b';
/// Tag of "completed with no value".
pub const TAG_NO_VALUE: u8 = b'n';
/// Tag of "completed, but the result could not be stored".
pub const TAG_NOT_STORABLE: u8 = b'x';
/// Tag of a user codec's bytes.
pub const TAG_USER_BYTES: u8 = b'u';
/// Tag of a user codec's text.
pub const TAG_USER_TEXT: u8 = b't';

/// Longest type name kept in a "not storable" record, in bytes (longer ones are cut at
/// a character boundary).
pub const MAX_TYPE_NAME: usize = 256;

/// A stored result, decoded: what the record says, before any host-language parsing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredResult<'a> {
    /// JSON text (parse it with the host's JSON parser).
    Json(&'a str),
    /// A byte string.
    Bytes(&'a [u8]),
    /// The action completed with no value (Python `None`, JavaScript `undefined`).
    NoValue,
    /// The action completed, but its result could not be encoded without changing
    /// it; replays get [`Error::ResultNotStored`] (see [`StoredResult::not_stored`]).
    NotStorable {
        /// The host-language type of the result.
        type_name: &'a str,
    },
    /// Bytes written by the store's user codec (give them to its decoder).
    UserBytes(&'a [u8]),
    /// Text written by the store's user codec (give it to its decoder).
    UserText(&'a str),
}

impl StoredResult<'_> {
    /// The record bytes: the tag, then the body. A type name longer than
    /// [`MAX_TYPE_NAME`] bytes is shortened.
    pub fn encode(&self) -> Vec<u8> {
        let (tag, body): (u8, &[u8]) = match *self {
            StoredResult::Json(text) => (TAG_JSON, text.as_bytes()),
            StoredResult::Bytes(b) => (TAG_BYTES, b),
            StoredResult::NoValue => (TAG_NO_VALUE, b""),
            StoredResult::NotStorable { type_name } => (
                TAG_NOT_STORABLE,
                shorten(type_name, MAX_TYPE_NAME).as_bytes(),
            ),
            StoredResult::UserBytes(b) => (TAG_USER_BYTES, b),
            StoredResult::UserText(text) => (TAG_USER_TEXT, text.as_bytes()),
        };
        let mut out = Vec::with_capacity(1 + body.len());
        out.push(tag);
        out.extend_from_slice(body);
        out
    }

    /// For [`StoredResult::NotStorable`], the error a later caller of `key` gets
    /// ([`Error::ResultNotStored`], DATA_LOSS); `None` for a result that can be read.
    pub fn not_stored(&self, key: &ScopedKey) -> Option<Error> {
        match *self {
            StoredResult::NotStorable { type_name } => Some(Error::ResultNotStored {
                key: key.to_string(),
                type_name: type_name.to_owned(),
            }),
            _ => None,
        }
    }
}

/// Reads a record's `result` field. An empty field, an unknown tag, or text that is
/// not UTF-8 is [`Error::Unavailable`]: the record was written by something that does
/// not follow this encoding, and it is not guessed at (fail closed).
pub fn decode(data: &[u8]) -> Result<StoredResult<'_>, Error> {
    let Some((&tag, body)) = data.split_first() else {
        return Err(Error::Unavailable(
            "the stored result is empty (expected a tag byte; see 'Result encoding' in \
             the oncely-redis README)"
                .into(),
        ));
    };
    let text = |what: &str| {
        std::str::from_utf8(body).map_err(|e| {
            Error::Unavailable(format!("the stored result's {what} is not UTF-8: {e}"))
        })
    };
    Ok(match tag {
        TAG_JSON => StoredResult::Json(text("JSON text")?),
        TAG_BYTES => StoredResult::Bytes(body),
        TAG_NO_VALUE if body.is_empty() => StoredResult::NoValue,
        TAG_NO_VALUE => {
            return Err(Error::Unavailable(
                "the stored result has tag 'n' (no value) but a body".into(),
            ))
        }
        TAG_NOT_STORABLE => StoredResult::NotStorable {
            type_name: text("type name")?,
        },
        TAG_USER_BYTES => StoredResult::UserBytes(body),
        TAG_USER_TEXT => StoredResult::UserText(text("user codec text")?),
        other => {
            return Err(Error::Unavailable(format!(
                "the stored result has an unknown encoding tag 0x{other:02x} (expected one \
                 of 'j', 'b', 'n', 'x', 'u', 't'; see 'Result encoding' in the oncely-redis \
                 README)"
            )))
        }
    })
}

fn shorten(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_kind() {
        for r in [
            StoredResult::Json("{\"a\":[1,\"é\"]}"),
            StoredResult::Bytes(b"\x00\xff"),
            StoredResult::Bytes(b""),
            StoredResult::NoValue,
            StoredResult::NotStorable {
                type_name: "decimal.Decimal",
            },
            StoredResult::UserBytes(b"\x80\x04K\x01."),
            StoredResult::UserText("{\"when\":\"2024-01-01\"}"),
        ] {
            assert_eq!(decode(&r.encode()).unwrap(), r);
        }
    }

    #[test]
    fn long_type_names_are_cut_at_a_char_boundary() {
        let name = "é".repeat(200);
        let record = StoredResult::NotStorable { type_name: &name }.encode();
        let StoredResult::NotStorable { type_name } = decode(&record).unwrap() else {
            panic!("not a not-storable record");
        };
        assert!(type_name.len() <= MAX_TYPE_NAME);
        assert!(name.starts_with(type_name));
    }

    #[test]
    fn not_stored_names_key_and_type() {
        let key = ScopedKey::new(
            "acme",
            "Pay",
            &oncely::IdempotencyKey::parse("key-0001").unwrap(),
        )
        .unwrap();
        let e = StoredResult::NotStorable { type_name: "Map" }
            .not_stored(&key)
            .unwrap();
        assert!(
            matches!(&e, Error::ResultNotStored { key: k, type_name } if *k == key.to_string() && type_name == "Map")
        );
        assert_eq!(e.code(), oncely::Code::DataLoss);
        assert!(StoredResult::NoValue.not_stored(&key).is_none());
    }
}
