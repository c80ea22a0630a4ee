//! The network fixture the benchmarks use is what it claims: with a 1 ms round trip,
//! every lookup that misses the client's caches costs at least that.

use std::{
    fs,
    time::{Duration, Instant},
};

use hocus_tests::NetworkMount;

#[test]
fn a_1_ms_round_trip_costs_every_uncached_lookup_at_least_1_ms() {
    let rtt = Duration::from_millis(1);
    let net = NetworkMount::start_with_round_trip(rtt);
    let n = 50;
    let started = Instant::now();
    for i in 0..n {
        // Names never looked up before: each is a request to the server.
        assert!(fs::metadata(net.path(&format!("missing-{i}"))).is_err());
    }
    let took = started.elapsed();
    assert!(took >= rtt * n, "{n} lookups took {took:?}");
    // And it still is a working share.
    let f = net.put("a.txt", b"hello\n");
    assert_eq!(fs::read(&f).unwrap(), b"hello\n");
}
