//! The segment server's bounds and deadlines, read by the server and by its outboxes alike (so
//! neither has to import the other for them).

use std::time::Duration;

/// The segment server's bounds and deadlines.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// How long a pulled stream waits for the capture's next segment, and how long a pull waits
    /// for its capture to start.
    pub idle: Duration,
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
            handshake: Duration::from_secs(10),
            max_connections: 64,
            grace: Duration::from_secs(30),
            pull_timeout: Duration::from_secs(120),
            memory_bound: 1 << 30,
        }
    }
}
