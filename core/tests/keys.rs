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

#[test]
fn a_missing_key_is_named_by_the_protocol_of_the_server() {
    use oncely::http::{Problem, ServerConfig};
    let config = ServerConfig::new();
    let http = config.read_key("POST", &[]).unwrap_err();
    let grpc = config
        .read_grpc_key("/shop.Orders/Create", &[])
        .unwrap_err();
    assert!(
        http.detail
            .starts_with("write operations require an Idempotency-Key header:"),
        "{}",
        http.detail
    );
    assert!(
        grpc.detail
            .starts_with("write operations require x-idempotency-key metadata:"),
        "{}",
        grpc.detail
    );
    assert!(!http.detail.contains("x-idempotency-key"));
    assert!(!grpc.detail.contains("Idempotency-Key header"));
    // Sent twice: the same naming.
    let twice = config.read_grpc_key("/shop.Orders/Create", &[b"order-0001", b"order-0002"]);
    assert!(twice
        .unwrap_err()
        .detail
        .contains("send one x-idempotency-key metadata"));
    // Without a server, the error names both.
    let text = Error::MissingKey.to_string();
    assert!(
        text.contains("Idempotency-Key") && text.contains("x-idempotency-key"),
        "{text}"
    );
    assert_eq!(
        Problem::from_error(&Error::MissingKey).detail,
        config.read_key("POST", &[]).unwrap_err().detail
    );
}
