//! The wire under attack, over real loopback TCP: who may pull a capture, what a fake or replayed
//! peer gets, and what a slow, greedy or absent peer can make the prefill host hold.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use half::bf16;
use pd_bridge_core::block::BlockWriter;
use pd_bridge_core::view::{ArrayView, LayerView};
use pd_bridge_core::segment::Segment;
use pd_bridge_core::ingest::{ingest, IngestControl, Pull};
use pd_bridge_core::segment_server::{SegmentServer, ServerConfig};
use pd_bridge_core::wire::secure::{self, Hello};
use pd_bridge_core::wire::{CaptureKey, CaptureSecret, Event, FrameLimits, Lane, PromptDigest, Seal, SegmentReader};
use pd_bridge_core::{CoreError, OmlxFormat};

const TOKEN: &[u8] = b"shared-token";
const FP: &str = "sha256:weights";

fn secret(b: u8) -> CaptureSecret {
    CaptureSecret::from_hex(&format!("{b:02x}").repeat(32)).unwrap()
}

fn prompt() -> PromptDigest {
    PromptDigest::of(&(0..64).collect::<Vec<u32>>())
}

/// A small segment of block `index` (two 8-token blocks per test capture).
fn seg(rid: &str, index: u32) -> Segment {
    let d: Vec<bf16> = (0..8 * 16).map(|i| bf16::from_f32((i + index as usize) as f32)).collect();
    let start = 8 * index as u64;
    Segment::from_views(OmlxFormat::Fork070, rid, FP, index, start, start + 8, &[LayerView::Kv(ArrayView::new(16, &d), ArrayView::new(16, &d))])
}

fn config() -> ServerConfig {
    ServerConfig { idle: Duration::from_secs(5), handshake: Duration::from_secs(3), ..ServerConfig::default() }
}

fn server(cfg: ServerConfig) -> SegmentServer {
    SegmentServer::bind_with("127.0.0.1:0", TOKEN.to_vec(), cfg).unwrap()
}

/// Register capture `rid` and fill it: two segments and a complete seal.
fn capture(srv: &SegmentServer, rid: &str, s: &CaptureSecret) -> Arc<pd_bridge_core::segment_server::Outbox> {
    let ob = srv.outbox(rid, s, FP, &prompt()).unwrap();
    assert!(ob.push(seg(rid, 0)) && ob.push(seg(rid, 1)));
    ob.seal(Seal::Complete { blocks: 2, tokens: 16 });
    ob
}

/// Register capture `rid`, fill it, and pull it whole; sealed only once the pull has taken both
/// segments (a pulled capture is past its grace's reach), so under a short grace the pull never
/// races the clock: a loaded machine may take longer than the grace to connect and handshake.
fn capture_and_pull(srv: &SegmentServer, rid: &str, s: &CaptureSecret) -> Result<Vec<u32>, CoreError> {
    let ob = srv.outbox(rid, s, FP, &prompt()).unwrap();
    assert!(ob.push(seg(rid, 0)) && ob.push(seg(rid, 1)));
    std::thread::scope(|scope| {
        let pull = scope.spawn(|| pull_events(srv.local_addr(), TOKEN, s, rid, FP, &prompt()));
        wait_until("the pull takes both segments", Duration::from_secs(60), || ob.queued_bytes() == 0 || pull.is_finished());
        ob.seal(Seal::Complete { blocks: 2, tokens: 16 });
        pull.join().unwrap()
    })
}

/// Pull `rid` with the given proof; every event until the seal, or the error.
fn pull_events(addr: SocketAddr, token: &[u8], s: &CaptureSecret, rid: &str, fp: &str, p: &PromptDigest) -> Result<Vec<u32>, CoreError> {
    let stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let key = CaptureKey::derive(token, s, rid, fp, p)?;
    let ch = secure::connect(stream, &key, rid)?;
    let mut r = SegmentReader::new(ch, rid, FP);
    let mut got = Vec::new();
    loop {
        match r.next_event()? {
            Event::Segment(seg) => got.push(seg.header.index),
            Event::Seal(_) => return Ok(got),
        }
    }
}

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "not within {limit:?}: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn only_the_token_and_this_captures_secret_prompt_and_weights_pull_it() {
    let srv = server(config());
    let s = secret(0x11);
    let ob = capture(&srv, "req", &s);
    let addr = srv.local_addr();
    for (token, sec, rid, fp, p, what) in [
        (&b"wrong-token"[..], s.clone(), "req", FP, prompt(), "another token"),
        (TOKEN, secret(0x22), "req", FP, prompt(), "another client's secret"),
        (TOKEN, s.clone(), "req", FP, PromptDigest::of(&[1, 2, 3]), "another prompt"),
        (TOKEN, s.clone(), "req", "sha256:other", prompt(), "other weights"),
    ] {
        match pull_events(addr, token, &sec, rid, fp, &p) {
            Err(CoreError::Auth(m)) => assert!(m.contains("refused") && m.contains("unauthorized"), "{what}: {m}"),
            other => panic!("{what}: {other:?}"),
        }
    }
    // A capture id nobody registered is refused after the wait for it to start.
    let short = server(ServerConfig { queue_wait: Duration::from_millis(300), ..config() });
    assert!(matches!(pull_events(short.local_addr(), TOKEN, &s, "req", FP, &prompt()), Err(CoreError::Auth(_))));
    // The refused attempts took nothing: the holder of the secret gets everything.
    assert_eq!(pull_events(addr, TOKEN, &s, "req", FP, &prompt()).unwrap(), vec![0, 1]);
    assert!(ob.closed_reason().is_none(), "{:?}", ob.closed_reason());
    wait_until("the sent outbox is dropped", Duration::from_secs(5), || srv.outboxes() == 0);
    assert_eq!(srv.queued_bytes(), 0);
}

/// A request vLLM queues behind others: the pull comes long before the capture starts, and the
/// capture's steps come slowly; each gap is longer than the decode host's idle deadline, and the
/// server's keepalives keep it from reading the busy host as a silent one.
#[test]
fn a_queued_and_slow_capture_outlasts_the_decode_hosts_idle_deadline() {
    let srv = Arc::new(server(ServerConfig { keepalive: Duration::from_millis(100), queue_wait: Duration::from_secs(60), ..config() }));
    let s = secret(0x11);
    let tokens: Vec<u32> = (0..16).collect();
    let gap = Duration::from_secs(4);
    let late = {
        let (srv, s, p) = (srv.clone(), s.clone(), PromptDigest::of(&tokens));
        std::thread::spawn(move || {
            std::thread::sleep(gap);
            let ob = srv.outbox("req", &s, FP, &p).unwrap();
            assert!(ob.push(seg("req", 0)));
            std::thread::sleep(gap);
            assert!(ob.push(seg("req", 1)));
            ob.seal(Seal::Complete { blocks: 2, tokens: 16 });
        })
    };
    let dir = common::temp_dir("wire-queued");
    let writer = BlockWriter::new(&dir, "/m", 8, &tokens).unwrap();
    let p = Pull { addrs: vec![srv.local_addr()], token: TOKEN, secret: &s, request_id: "req", fingerprint: FP, prompt: PromptDigest::of(&tokens), limits: FrameLimits::default(), timeout: gap / 2, lanes: 1, stages: 1 };
    let got = ingest(&p, &writer, &IngestControl::default(), |_| {});
    late.join().unwrap();
    assert_eq!(got.outcome.unwrap(), Seal::Complete { blocks: 2, tokens: 16 });
    assert_eq!(got.blocks, 2);
}

/// A pull that comes after its capture was dropped is told why at once, not held for the
/// queue wait and then refused as unknown.
#[test]
fn a_pull_after_its_capture_was_dropped_is_refused_at_once_with_the_reason() {
    let srv = server(ServerConfig { grace: Duration::from_millis(200), queue_wait: Duration::from_secs(600), ..config() });
    let s = secret(0x11);
    capture(&srv, "late", &s);
    wait_until("the unpulled capture is dropped", Duration::from_secs(5), || srv.outboxes() == 0);
    match pull_events(srv.local_addr(), TOKEN, &s, "late", FP, &prompt()) {
        Err(CoreError::Auth(m)) => assert!(m.contains("no longer here") && m.contains("not pulled within"), "{m}"),
        other => panic!("{other:?}"),
    }
    // Pulled to the end: a second pull hears that.
    assert_eq!(capture_and_pull(&srv, "twice", &s).unwrap(), vec![0, 1]);
    wait_until("the sent capture leaves", Duration::from_secs(5), || srv.outboxes() == 0);
    match pull_events(srv.local_addr(), TOKEN, &s, "twice", FP, &prompt()) {
        Err(CoreError::Auth(m)) => assert!(m.contains("already pulled"), "{m}"),
        other => panic!("{other:?}"),
    }
    // A new capture under a buried id is pullable again.
    assert_eq!(capture_and_pull(&srv, "late", &s).unwrap(), vec![0, 1]);
}

/// A server that does not know the token, standing in for the prefill host: it answers the hello
/// with a handshake message of its own and then streams zeros.
fn fake_server(answer: impl Fn(&mut TcpStream, &Hello) + Send + 'static) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in l.incoming().take(4) {
            let mut s = conn.unwrap();
            if let Ok(h) = Hello::read(&mut s) {
                answer(&mut s, &h);
                let _ = s.write_all(&vec![0u8; 1 << 20]);
            }
        }
    });
    addr
}

fn ingest_from(addr: SocketAddr, dir: &std::path::Path) -> pd_bridge_core::ingest::Ingested {
    let tokens: Vec<u32> = (0..16).collect();
    let writer = BlockWriter::new(dir, "/m", 8, &tokens).unwrap();
    let s = secret(0x11);
    let p = Pull { addrs: vec![addr], token: TOKEN, secret: &s, request_id: "req", fingerprint: FP, prompt: PromptDigest::of(&tokens), limits: FrameLimits::default(), timeout: Duration::from_secs(5), lanes: 1, stages: 1 };
    ingest(&p, &writer, &IngestControl::default(), |_| {})
}

#[test]
fn a_fake_prefill_server_fails_the_handshake_before_a_byte_is_written() {
    // Answers "accept" with random bytes where its handshake message belongs.
    let random = fake_server(|s, _| {
        let mut m = vec![b'P', b'D', b'B', b'W', pd_bridge_core::wire::VERSION, 2, 48, 0];
        m.extend((0..48u8).map(|i| i.wrapping_mul(37)));
        let _ = s.write_all(&m);
    });
    // Runs the real handshake, keyed with a token it guessed.
    let guessed = fake_server(|s, h| {
        let key = CaptureKey::derive(b"guess", &secret(0x11), &h.request_id, FP, &PromptDigest::of(&(0..16).collect::<Vec<u32>>())).unwrap();
        match h.try_key(&key) {
            Some(m) => drop(secure::accept(s.try_clone().unwrap(), h, m)),
            // Its key does not open the hello: it answers "accept" all the same.
            None => drop(s.write_all(&[&b"PDBW"[..], &[pd_bridge_core::wire::VERSION, 2, 48, 0], &[7u8; 48]].concat())),
        }
    });
    for (addr, what) in [(random, "random answer"), (guessed, "guessed token")] {
        let dir = common::temp_dir("fake");
        let got = ingest_from(addr, &dir);
        assert_eq!(got.blocks, 0, "{what}");
        match &got.outcome {
            Err(CoreError::Auth(m)) => assert!(m.contains("failed the handshake") || m.contains("refused"), "{what}: {m}"),
            other => panic!("{what}: {other:?}"),
        }
        assert!(common::files_under(&dir).is_empty(), "{what}");
    }
}

/// A TCP proxy to `to` that records what each side sent.
fn recording_proxy(to: SocketAddr) -> (SocketAddr, Arc<Mutex<Vec<u8>>>, Arc<Mutex<Vec<u8>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let (up, down) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(Vec::new())));
    let (u, d) = (up.clone(), down.clone());
    std::thread::spawn(move || {
        let (client, _) = l.accept().unwrap();
        let server = TcpStream::connect(to).unwrap();
        let pipe = |mut from: TcpStream, mut to: TcpStream, log: Arc<Mutex<Vec<u8>>>| {
            std::thread::spawn(move || {
                let mut buf = [0u8; 65536];
                while let Ok(n) = from.read(&mut buf) {
                    if n == 0 || to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                    log.lock().unwrap().extend_from_slice(&buf[..n]);
                }
                let _ = to.shutdown(std::net::Shutdown::Write);
            })
        };
        let a = pipe(client.try_clone().unwrap(), server.try_clone().unwrap(), u);
        let b = pipe(server, client, d);
        let _ = (a.join(), b.join());
    });
    (addr, up, down)
}

#[test]
fn a_recorded_stream_cannot_be_replayed_for_another_request_or_the_same_one() {
    let srv = server(config());
    let s = secret(0x11);
    capture(&srv, "req", &s);
    let (via, up, down) = recording_proxy(srv.local_addr());
    assert_eq!(pull_events(via, TOKEN, &s, "req", FP, &prompt()).unwrap(), vec![0, 1]);
    std::thread::sleep(Duration::from_millis(200));
    let (up, down) = (up.lock().unwrap().clone(), down.lock().unwrap().clone());
    assert!(down.len() > 2 * 8 * 16 * 2 * 2, "the recording holds the stream ({} bytes)", down.len());

    // The prefill host's recorded answer and segments, replayed to a decode host: for another
    // request id (rewritten or not), and for the very same request.
    for (rid, what) in [("other", "another request"), ("req", "the same request")] {
        let recorded = down.clone();
        let replay = fake_server(move |s, _| {
            let _ = s.write_all(&recorded);
        });
        match pull_events(replay, TOKEN, &s, rid, FP, &prompt()) {
            Err(CoreError::Auth(m)) => assert!(m.contains("failed the handshake"), "{what}: {m}"),
            other => panic!("{what}: {other:?}"),
        }
    }

    // The decode host's recorded hello and pull, replayed to the prefill host for a new capture
    // with the same id and key: the hello passes the key check, but without the ephemeral key
    // the pull cannot be forged, so nothing is streamed and the capture stays for its owner.
    let again = capture(&srv, "req", &s);
    let mut c = TcpStream::connect(srv.local_addr()).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(&up).unwrap();
    let mut got = Vec::new();
    let _ = c.read_to_end(&mut got);
    assert!(got.len() < 128, "a replayed hello got {} bytes (only the handshake answer is allowed)", got.len());
    assert!(again.closed_reason().is_none());
    assert_eq!(pull_events(srv.local_addr(), TOKEN, &s, "req", FP, &prompt()).unwrap(), vec![0, 1]);
}

#[test]
fn a_hello_is_bounded_before_any_key_is_known() {
    let srv = server(config());
    for bad in [
        [&b"PDBW"[..], &[pd_bridge_core::wire::VERSION, 1], &u16::MAX.to_le_bytes()].concat(),
        [&b"PDBW"[..], &[1, 1, 0, 0]].concat(),
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
    ] {
        let mut c = TcpStream::connect(srv.local_addr()).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(&bad).unwrap();
        let t0 = Instant::now();
        let mut got = Vec::new();
        let _ = c.read_to_end(&mut got);
        assert!(t0.elapsed() < Duration::from_secs(2), "{bad:?} held the connection for {:?}", t0.elapsed());
    }
    wait_until("connections are released", Duration::from_secs(5), || srv.connections() == 0);
}

#[test]
fn a_slow_client_is_cut_at_the_handshake_deadline() {
    let srv = server(ServerConfig { handshake: Duration::from_millis(600), ..config() });
    capture(&srv, "req", &secret(0x11));
    let mut c = TcpStream::connect(srv.local_addr()).unwrap();
    c.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    // A real hello, one byte every 100 ms: 60 bytes would take 6 s.
    let key = CaptureKey::derive(TOKEN, &secret(0x11), "req", FP, &prompt()).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let hello_bytes = {
        // Capture what connect() would send by running it against a local sink.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut b = vec![0u8; 512];
            let n = s.read(&mut b).unwrap();
            tx.send(b[..n].to_vec()).unwrap();
        });
        let sink = TcpStream::connect(a).unwrap();
        sink.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        let _ = secure::connect(sink, &key, "req");
        rx.recv().unwrap()
    };
    let t0 = Instant::now();
    let mut closed = false;
    for b in &hello_bytes {
        if c.write_all(&[*b]).is_err() {
            closed = true;
            break;
        }
        let mut x = [0u8; 16];
        match c.read(&mut x) {
            Ok(0) => {
                closed = true;
                break;
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => {
                closed = true;
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(closed, "the server kept a client that took {:?} over its hello", t0.elapsed());
    assert!(t0.elapsed() < Duration::from_secs(4), "closed only after {:?}", t0.elapsed());
    wait_until("the slot is released", Duration::from_secs(5), || srv.connections() == 0);
}

#[test]
fn connections_past_the_cap_are_refused_at_once() {
    let srv = server(ServerConfig { max_connections: 2, handshake: Duration::from_millis(800), ..config() });
    let s = secret(0x11);
    capture(&srv, "req", &s);
    let idle: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(srv.local_addr()).unwrap()).collect();
    wait_until("two connections held", Duration::from_secs(5), || srv.connections() == 2);
    match pull_events(srv.local_addr(), TOKEN, &s, "req", FP, &prompt()) {
        Err(CoreError::Auth(m)) => assert!(m.contains("busy"), "{m}"),
        other => panic!("{other:?}"),
    }
    // The silent ones hit their handshake deadline; then the port serves again.
    wait_until("the silent connections are dropped", Duration::from_secs(5), || srv.connections() == 0);
    drop(idle);
    assert_eq!(pull_events(srv.local_addr(), TOKEN, &s, "req", FP, &prompt()).unwrap(), vec![0, 1]);
}

#[test]
fn captures_nobody_pulls_are_dropped_after_the_grace_or_the_pull_timeout() {
    let srv = server(ServerConfig { grace: Duration::from_millis(300), pull_timeout: Duration::from_millis(1500), ..config() });
    let sealed = capture(&srv, "sealed", &secret(0x11));
    let open = srv.outbox("open", &secret(0x11), FP, &prompt()).unwrap();
    assert!(open.push(seg("open", 0)));
    assert_eq!(srv.outboxes(), 2);
    assert!(srv.queued_bytes() > 0);
    wait_until("the sealed capture is dropped after its grace", Duration::from_secs(5), || sealed.closed_reason().is_some());
    assert!(sealed.closed_reason().unwrap().contains("not pulled within the"), "{:?}", sealed.closed_reason());
    assert!(open.closed_reason().is_none(), "the unsealed capture is still within its pull timeout");
    wait_until("the unsealed capture is dropped after the pull timeout", Duration::from_secs(5), || open.closed_reason().is_some());
    assert!(open.closed_reason().unwrap().contains("not pulled within"), "{:?}", open.closed_reason());
    assert!(!open.push(seg("open", 1)), "a dropped capture takes no more segments");
    wait_until("nothing held", Duration::from_secs(5), || srv.outboxes() == 0);
    assert_eq!(srv.queued_bytes(), 0);
}

#[test]
fn past_the_memory_bound_the_oldest_unpulled_capture_is_dropped() {
    let one = pd_bridge_core::wire::segment_payload_len(&seg("a", 0));
    let srv = server(ServerConfig { memory_bound: 3 * one, ..config() });
    let a = srv.outbox("a", &secret(0x11), FP, &prompt()).unwrap();
    let b = srv.outbox("b", &secret(0x11), FP, &prompt()).unwrap();
    assert!(a.push(seg("a", 0)) && a.push(seg("a", 1)));
    assert!(b.push(seg("b", 0)));
    assert!(b.push(seg("b", 1)), "the newer capture keeps going");
    let why = a.closed_reason().expect("the oldest unpulled capture is dropped");
    assert!(why.contains("memory bound"), "{why}");
    assert!(b.closed_reason().is_none());
    assert!(srv.queued_bytes() <= 3 * one, "{} > {}", srv.queued_bytes(), 3 * one);
}

#[test]
fn a_reader_that_goes_away_closes_the_capture_with_the_reason() {
    let srv = server(config());
    let s = secret(0x11);
    let ob = srv.outbox("req", &s, FP, &prompt()).unwrap();
    {
        let stream = TcpStream::connect(srv.local_addr()).unwrap();
        let key = CaptureKey::derive(TOKEN, &s, "req", FP, &prompt()).unwrap();
        let _ch = secure::connect(stream, &key, "req").unwrap();
        // dropped here: the decode host went away after its pull
    }
    let t0 = Instant::now();
    let mut i = 0;
    while ob.closed_reason().is_none() && t0.elapsed() < Duration::from_secs(10) {
        let big: Vec<bf16> = vec![bf16::ONE; 256 * 1024];
        let s = Segment::from_views(OmlxFormat::Fork070, "req", FP, i, 8 * i as u64, 8 * i as u64 + 8, &[LayerView::Kv(ArrayView::new(1024, &big), ArrayView::new(1024, &big))]);
        ob.push(s);
        i += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    let why = ob.closed_reason().expect("the capture learns its reader is gone");
    assert!(why.contains("ended after"), "{why}");
    assert!(!ob.push(seg("req", 0)));
}

/// Pull lane `lane` of `count` of `rid` with the right proof; the segment indices it carried.
fn pull_lane(addr: SocketAddr, s: &CaptureSecret, rid: &str, lane: Lane) -> Result<Vec<u32>, CoreError> {
    let stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let key = CaptureKey::derive(TOKEN, s, rid, FP, &prompt())?;
    let ch = secure::connect_lane(stream, &key, rid, lane)?;
    let mut r = SegmentReader::new(ch, rid, FP).on_lane(lane);
    let mut got = Vec::new();
    loop {
        match r.next_event()? {
            Event::Segment(seg) => got.push(seg.header.index),
            Event::Seal(_) => return Ok(got),
        }
    }
}

/// Lanes split a capture by segment index; a lane taken twice, or asked for with another lane
/// count, is refused naming why; the outbox leaves only when every lane has sent the seal.
#[test]
fn lanes_split_a_capture_and_are_claimed_once_each() {
    let srv = server(config());
    let s = secret(7);
    let ob = srv.outbox("req", &s, FP, &prompt()).unwrap();
    for i in 0..5 {
        assert!(ob.push(seg("req", i)));
    }
    ob.seal(Seal::Complete { blocks: 5, tokens: 40 });
    let addr = srv.local_addr();
    assert_eq!(pull_lane(addr, &s, "req", Lane::new(1, 2).unwrap()).unwrap(), vec![1, 3]);
    // Lane 1 sent its seal; lane 0 still owes 0, 2, 4: the outbox stays.
    assert_eq!(srv.outboxes(), 1);
    let again = pull_lane(addr, &s, "req", Lane::new(1, 2).unwrap()).unwrap_err().to_string();
    assert!(again.contains("lane 1 of 2 of this capture is already being pulled"), "{again}");
    let other = pull_lane(addr, &s, "req", Lane::new(0, 3).unwrap()).unwrap_err().to_string();
    assert!(other.contains("being pulled over 2 lanes, not 3"), "{other}");
    assert_eq!(pull_lane(addr, &s, "req", Lane::new(0, 2).unwrap()).unwrap(), vec![0, 2, 4]);
    wait_until("the outbox retired", Duration::from_secs(5), || srv.outboxes() == 0);
    assert_eq!((srv.queued_bytes(), srv.accounting_faults()), (0, 0));
}

/// A lane's number is bound into its handshake: a hello whose lane bytes were changed on the
/// way (to take another lane's segments) fails the key; a lane that does not exist is refused.
#[test]
fn a_lane_cannot_be_passed_off_as_another() {
    let s = secret(8);
    let key = CaptureKey::derive(TOKEN, &s, "req", FP, &prompt()).unwrap();
    let mut hello = Vec::new();
    let _ = secure::connect_lane(&mut hello_sink(&mut hello), &key, "req", Lane::new(1, 2).unwrap());
    // "PDBW" | version | kind | u16 id length | "req" | lane | lanes
    let at = 4 + 2 + 2 + 3;
    assert_eq!(&hello[at..at + 2], &[1, 2]);
    let mut swapped = hello.clone();
    swapped[at] = 0;
    let h = Hello::read(&mut &swapped[..]).unwrap();
    assert_eq!(h.lane, Lane::new(0, 2).unwrap());
    assert!(h.try_key(&key).is_none(), "a hello with a changed lane matched the key");
    assert!(Hello::read(&mut &hello[..]).unwrap().try_key(&key).is_some());
    let mut bad = hello.clone();
    bad[at] = 2;
    let e = Hello::read(&mut &bad[..]).unwrap_err().to_string();
    assert!(e.contains("lane 2 of 2 does not exist"), "{e}");
    bad[at + 1] = 17;
    let e = Hello::read(&mut &bad[..]).unwrap_err().to_string();
    assert!(e.contains("must be 1 to 16"), "{e}");
}

/// Records what is written and answers nothing (the handshake then fails on the read).
fn hello_sink(out: &mut Vec<u8>) -> impl Read + Write + '_ {
    struct Sink<'a>(&'a mut Vec<u8>);
    impl Read for Sink<'_> {
        fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
            Ok(0)
        }
    }
    impl Write for Sink<'_> {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    Sink(out)
}

/// A decode host that opens one lane of two and never the other: the capture is dropped once
/// the handshake deadline has passed since the first lane, naming the missing lane, and a pull of
/// the missing lane after that hears why.
#[test]
fn a_lane_that_never_comes_drops_the_capture_with_the_reason() {
    let srv = server(ServerConfig { handshake: Duration::from_millis(500), ..config() });
    let s = secret(9);
    let ob = srv.outbox("req", &s, FP, &prompt()).unwrap();
    for i in 0..4 {
        assert!(ob.push(seg("req", i)));
    }
    ob.seal(Seal::Complete { blocks: 4, tokens: 32 });
    assert_eq!(pull_lane(srv.local_addr(), &s, "req", Lane::new(0, 2).unwrap()).unwrap(), vec![0, 2]);
    wait_until("the half-pulled capture dropped", Duration::from_secs(5), || srv.outboxes() == 0);
    assert_eq!(ob.closed_reason().unwrap(), "only 1 of its 2 lanes were pulled within 500ms of the first");
    assert_eq!((srv.queued_bytes(), srv.accounting_faults()), (0, 0));
    let late = pull_lane(srv.local_addr(), &s, "req", Lane::new(1, 2).unwrap()).unwrap_err().to_string();
    assert!(late.contains("only 1 of its 2 lanes"), "{late}");
}
