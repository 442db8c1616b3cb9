//! The segment server's bounds and deadlines, read by the server and by its outboxes alike (so
//! neither has to import the other for them).

use std::time::Duration;

/// The segment server's bounds and deadlines.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// How long a pulled stream waits for the capture's next segment.
    pub idle: Duration,
    /// How long a pull waits for its capture to start: vLLM may queue a request behind others
    /// (many bridges at once, long prompts) well past the idle deadline.
    pub queue_wait: Duration,
    /// While a pull waits (for its capture to start, or for the next segment), the server tells
    /// the decode host it is alive this often, so that the decode host's idle deadline measures
    /// a silent host and not a busy engine.
    pub keepalive: Duration,
    /// From accepting a connection to the client's first frame under the session keys (hello,
    /// handshake, pull), however slowly the client sends.
    pub handshake: Duration,
    /// Connections at once; more are refused at once.
    pub max_connections: usize,
    /// A sealed capture nobody pulled is dropped this long after its seal.
    pub grace: Duration,
    /// A capture nobody pulled is dropped this long after it started, sealed or not.
    pub pull_timeout: Duration,
    /// Segment bytes all outboxes may hold together; past it the oldest unpulled captures are
    /// dropped.
    pub memory_bound: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            idle: Duration::from_secs(60),
            queue_wait: Duration::from_secs(600),
            keepalive: Duration::from_secs(5),
            handshake: Duration::from_secs(10),
            max_connections: 64,
            grace: Duration::from_secs(30),
            pull_timeout: Duration::from_secs(120),
            memory_bound: 1 << 30,
        }
    }
}
