//! Scoped keys read back from text: only the canonical encoding is accepted.

use oncely::{Error, IdempotencyKey, ScopedKey};

#[test]
fn scoped_key_parse_accepts_only_what_new_makes() {
    let key = IdempotencyKey::parse("key-0001").unwrap();
    for (tenant, method) in [("acme", "/a.B/C"), ("a:b", "%"), ("é", "{x} y")] {
        let k = ScopedKey::new(tenant, method, &key).unwrap();
        assert_eq!(ScopedKey::parse(k.as_str()).unwrap(), k);
    }
    for bad in [
        "",
        "acme:m:key-0001",
        "v2:acme:m:key-0001",
        "v1:acme:key-0001",
        "v1::m:key-0001",
        "v1:acme:m:bad key!",
        "v1:a%zz:m:key-0001",
        "v1:a%2:m:key-0001",
        "v1:a%3a:m:key-0001",
        "v1:%61cme:m:key-0001",
        "v1:a%FF:m:key-0001",
        "v1:a b:m:key-0001",
    ] {
        let e = ScopedKey::parse(bad).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { .. } | Error::MissingKey),
            "{bad:?} gave {e:?}"
        );
    }
}
