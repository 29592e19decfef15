//! Finds NaN and infinite floats anywhere in a `Serialize` value.
//!
//! serde_json (and serde_jcs, which writes through it) turns a non-finite float inside
//! an array or object into `null` without an error, so `[NaN]` and `[null]` would get
//! one fingerprint. JSON has no such numbers: canonical JSON refuses them (SPEC §6), as
//! the Python and Node bindings do. No crate offers this walk; it is a serializer that
//! writes nothing and stops at the first non-finite float.

use std::fmt;

use serde::ser::{self, Serialize};

/// Whether `value` holds a NaN or an infinite `f32`/`f64` anywhere.
pub(crate) fn has_non_finite<T: Serialize + ?Sized>(value: &T) -> bool {
    matches!(value.serialize(Walk), Err(Found::NonFinite))
}

#[derive(Debug)]
enum Found {
    NonFinite,
    /// The value's own `Serialize` failed; serde_jcs reports that itself.
    Other,
}

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Found::NonFinite => "a non-finite float",
            Found::Other => "a serialization error",
        })
    }
}

impl std::error::Error for Found {}

impl ser::Error for Found {
    fn custom<M: fmt::Display>(_: M) -> Self {
        Found::Other
    }
}

struct Walk;

type R = Result<(), Found>;

fn float(x: f64) -> R {
    if x.is_finite() {
        Ok(())
    } else {
        Err(Found::NonFinite)
    }
}

impl ser::Serializer for Walk {
    type Ok = ();
    type Error = Found;
    type SerializeSeq = Walk;
    type SerializeTuple = Walk;
    type SerializeTupleStruct = Walk;
    type SerializeTupleVariant = Walk;
    type SerializeMap = Walk;
    type SerializeStruct = Walk;
    type SerializeStructVariant = Walk;

    fn serialize_bool(self, _: bool) -> R {
        Ok(())
    }
    fn serialize_i8(self, _: i8) -> R {
        Ok(())
    }
    fn serialize_i16(self, _: i16) -> R {
        Ok(())
    }
    fn serialize_i32(self, _: i32) -> R {
        Ok(())
    }
    fn serialize_i64(self, _: i64) -> R {
        Ok(())
    }
    fn serialize_i128(self, _: i128) -> R {
        Ok(())
    }
    fn serialize_u8(self, _: u8) -> R {
        Ok(())
    }
    fn serialize_u16(self, _: u16) -> R {
        Ok(())
    }
    fn serialize_u32(self, _: u32) -> R {
        Ok(())
    }
    fn serialize_u64(self, _: u64) -> R {
        Ok(())
    }
    fn serialize_u128(self, _: u128) -> R {
        Ok(())
    }
    fn serialize_f32(self, v: f32) -> R {
        float(f64::from(v))
    }
    fn serialize_f64(self, v: f64) -> R {
        float(v)
    }
    fn serialize_char(self, _: char) -> R {
        Ok(())
    }
    fn serialize_str(self, _: &str) -> R {
        Ok(())
    }
    fn serialize_bytes(self, _: &[u8]) -> R {
        Ok(())
    }
    fn serialize_none(self) -> R {
        Ok(())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, v: &T) -> R {
        v.serialize(Walk)
    }
    fn serialize_unit(self) -> R {
        Ok(())
    }
    fn serialize_unit_struct(self, _: &'static str) -> R {
        Ok(())
    }
    fn serialize_unit_variant(self, _: &'static str, _: u32, _: &'static str) -> R {
        Ok(())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, _: &'static str, v: &T) -> R {
        v.serialize(Walk)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        v: &T,
    ) -> R {
        v.serialize(Walk)
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Walk, Found> {
        Ok(Walk)
    }
    fn serialize_tuple(self, _: usize) -> Result<Walk, Found> {
        Ok(Walk)
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Walk, Found> {
        Ok(Walk)
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Walk, Found> {
        Ok(Walk)
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Walk, Found> {
        Ok(Walk)
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Walk, Found> {
        Ok(Walk)
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Walk, Found> {
        Ok(Walk)
    }
}

impl ser::SerializeSeq for Walk {
    type Ok = ();
    type Error = Found;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, v: &T) -> R {
        v.serialize(Walk)
    }
    fn end(self) -> R {
        Ok(())
    }
}

impl ser::SerializeTuple for Walk {
    type Ok = ();
    type Error = Found;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, v: &T) -> R {
        v.serialize(Walk)
    }
    fn end(self) -> R {
        Ok(())
    }
}

impl ser::SerializeTupleStruct for Walk {
    type Ok = ();
    type Error = Found;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, v: &T) -> R {
        v.serialize(Walk)
    }
    fn end(self) -> R {
        Ok(())
    }
}

impl ser::SerializeTupleVariant for Walk {
    type Ok = ();
    type Error = Found;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, v: &T) -> R {
        v.serialize(Walk)
    }
    fn end(self) -> R {
        Ok(())
    }
}

impl ser::SerializeMap for Walk {
    type Ok = ();
    type Error = Found;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, k: &T) -> R {
        k.serialize(Walk)
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, v: &T) -> R {
        v.serialize(Walk)
    }
    fn end(self) -> R {
        Ok(())
    }
}

impl ser::SerializeStruct for Walk {
    type Ok = ();
    type Error = Found;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, _: &'static str, v: &T) -> R {
        v.serialize(Walk)
    }
    fn end(self) -> R {
        Ok(())
    }
}

impl ser::SerializeStructVariant for Walk {
    type Ok = ();
    type Error = Found;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, _: &'static str, v: &T) -> R {
        v.serialize(Walk)
    }
    fn end(self) -> R {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::has_non_finite;
    use std::collections::BTreeMap;

    #[test]
    fn finds_non_finite_floats_at_any_depth() {
        assert!(has_non_finite(&f64::NAN));
        assert!(has_non_finite(&vec![1.0, f64::INFINITY]));
        assert!(has_non_finite(&BTreeMap::from([(
            "a",
            vec![Some(f32::NEG_INFINITY)]
        )])));
        assert!(!has_non_finite(&vec![1.0, -0.0, f64::MAX]));
        assert!(!has_non_finite(
            &serde_json::json!({"a": [1, "x", null, {"b": 2.5}]})
        ));
    }
}
