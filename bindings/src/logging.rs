//! The core's `tracing` events into Python's `logging`.
//!
//! Loggers: `pd_bridge.core.<module>` for the core (`pd_bridge_core::segment_server` ->
//! `pd_bridge.core.segment_server`), `pd_bridge.bindings` for this crate, `pd_bridge.omlx` /
//! `pd_bridge.vllm` for the wheels' own events. Each record carries `request_id` (the event's
//! `request_id` or `request` field, else the nearest enclosing span's) and `pd_bridge_fields`
//! (every field as text); its message reads `pd-bridge[<request id>]: <message> (k=v, ...)`, as
//! the Python side's own lines do, and its pathname/lineno are the Rust source's.
//!
//! Cheap when the level is off: an event below the level Python's loggers let through is dropped
//! by one atomic load, before any field is formatted. That level is read from Python by the
//! binding entry points ([`crate::guard`]), at most every [`REFRESH_MS`] ms (reading it costs a
//! few microseconds, too much for every `feed`), so `logging.getLogger("pd_bridge").setLevel(...)`
//! applies from the first call into the module that much later.
//!
//! Events are handed to Python from a thread of their own ("pd-bridge-log"): the thread that
//! emits one may hold a core lock that a Python thread (holding the interpreter) waits for, so it
//! must never wait for the interpreter itself. A bounded queue sits between them; when Python
//! falls that far behind, events are counted and the count is logged instead.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Mutex, OnceLock};

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyCFunction, PyDict};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record as SpanRecord};
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;
use tracing_subscriber::registry::LookupSpan;

/// Events queued for Python at most; past this they are counted, not kept.
pub const QUEUE: usize = 4096;
/// Longest a level set in Python goes unnoticed while the module is being called.
pub const REFRESH_MS: u64 = 100;

/// Least tracing level forwarded, as [`rank`]: 0 trace ... 4 error, 5 none. Until Python's level
/// is first read: warnings and errors (Python's default).
static FLOOR: AtomicU8 = AtomicU8::new(3);
/// Set at interpreter exit: nothing is handed to Python after it.
static STOPPED: AtomicBool = AtomicBool::new(false);
static DROPPED: AtomicU64 = AtomicU64::new(0);
/// When the level was last read, in ms since [`EPOCH`] plus one (0: never).
static LAST_REFRESH: AtomicU64 = AtomicU64::new(0);
static EPOCH: OnceLock<std::time::Instant> = OnceLock::new();

/// Tests that set [`FLOOR`] (or read Python's level into it) run one at a time.
#[cfg(test)]
pub(crate) static TEST_LOCK: Mutex<()> = Mutex::new(());

fn rank(level: &Level) -> u8 {
    match *level {
        Level::TRACE => 0,
        Level::DEBUG => 1,
        Level::INFO => 2,
        Level::WARN => 3,
        Level::ERROR => 4,
    }
}

/// Python's level number for a tracing level (TRACE: 5, below DEBUG).
pub fn python_level(level: &Level) -> i32 {
    match *level {
        Level::TRACE => 5,
        Level::DEBUG => 10,
        Level::INFO => 20,
        Level::WARN => 30,
        Level::ERROR => 40,
    }
}

/// The least [`rank`] a Python level number lets through.
fn floor_for(python_level: i64) -> u8 {
    match python_level {
        i64::MIN..=5 => 0,
        6..=10 => 1,
        11..=20 => 2,
        21..=30 => 3,
        31..=40 => 4,
        _ => 5,
    }
}

/// The Python logger for a tracing target.
pub fn logger_name(target: &str) -> String {
    let (krate, rest) = target.split_once("::").unwrap_or((target, ""));
    let base = match krate {
        "pd_bridge_core" => "pd_bridge.core".to_string(),
        "pd_bridge_bindings" => "pd_bridge.bindings".to_string(),
        "pd_bridge_omlx_native" => "pd_bridge.omlx".to_string(),
        "pd_bridge_vllm_native" => "pd_bridge.vllm".to_string(),
        other => format!("pd_bridge.rust.{other}"),
    };
    if rest.is_empty() {
        base
    } else {
        format!("{base}.{}", rest.replace("::", "."))
    }
}

/// One event, ready for Python.
#[derive(Debug, Clone)]
pub struct LogRecord {
    pub logger: String,
    pub level: i32,
    pub file: String,
    pub line: u32,
    pub message: String,
    pub request_id: Option<String>,
    /// Every field of the event (not of its spans), as text, `message` aside.
    pub fields: Vec<(String, String)>,
}

/// Fields as text, in order.
#[derive(Default)]
struct Fields(Vec<(&'static str, String)>);

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.push((field.name(), value.to_string()));
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name(), format!("{value:?}")));
    }
}

impl Fields {
    fn request_id(&self) -> Option<&str> {
        self.0.iter().find(|(k, _)| *k == "request_id" || *k == "request").map(|(_, v)| v.as_str())
    }
}

/// The `tracing` layer; `sink` receives each event that passes the level.
pub struct PyLogging<F> {
    sink: F,
}

impl<F: Fn(LogRecord) + Send + Sync + 'static> PyLogging<F> {
    pub fn new(sink: F) -> Self {
        PyLogging { sink }
    }
}

impl<S, F> Layer<S> for PyLogging<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    F: Fn(LogRecord) + Send + Sync + 'static,
{
    fn register_callsite(&self, meta: &'static Metadata<'static>) -> Interest {
        // Spans always: a span's request id must be there for any event under it, whatever the
        // level. Events: asked each time, so a level changed in Python applies at once.
        if meta.is_span() {
            Interest::always()
        } else {
            Interest::sometimes()
        }
    }

    fn enabled(&self, meta: &Metadata<'_>, _ctx: Context<'_, S>) -> bool {
        meta.is_span() || rank(meta.level()) >= FLOOR.load(Ordering::Relaxed)
    }

    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(fields);
        }
    }

    fn on_record(&self, id: &Id, values: &SpanRecord<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            let mut ext = span.extensions_mut();
            if let Some(fields) = ext.get_mut::<Fields>() {
                values.record(fields);
            }
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let mut request_id = fields.request_id().map(str::to_string);
        if request_id.is_none() {
            if let Some(scope) = ctx.event_scope(event) {
                for span in scope {
                    if let Some(id) = span.extensions().get::<Fields>().and_then(|f| f.request_id().map(str::to_string)) {
                        request_id = Some(id);
                        break;
                    }
                }
            }
        }
        let meta = event.metadata();
        let mut message = String::new();
        let mut rest: Vec<(String, String)> = Vec::new();
        for (k, v) in fields.0 {
            if k == "message" {
                message = v;
            } else {
                rest.push((k.to_string(), v));
            }
        }
        let mut text = match &request_id {
            Some(id) => format!("pd-bridge[{id}]: {message}"),
            None => format!("pd-bridge: {message}"),
        };
        let shown: Vec<&(String, String)> = rest.iter().filter(|(k, _)| k != "request_id" && k != "request").collect();
        if !shown.is_empty() {
            text.push_str(" (");
            for (i, (k, v)) in shown.iter().enumerate() {
                let _ = write!(text, "{}{k}={v}", if i == 0 { "" } else { ", " });
            }
            text.push(')');
        }
        (self.sink)(LogRecord {
            logger: logger_name(meta.target()),
            level: python_level(meta.level()),
            file: meta.file().unwrap_or("<rust>").to_string(),
            line: meta.line().unwrap_or(0),
            message: text,
            request_id,
            fields: rest,
        });
    }
}

/// Python helpers: the level floor over pd-bridge's loggers, and emitting one record.
const HELPERS: &std::ffi::CStr = cr#"
import logging

_LOGGERS = [logging.getLogger(n) for n in ("pd_bridge.core", "pd_bridge.bindings", "pd_bridge.omlx", "pd_bridge.vllm")]


def floor():
    level = min(lg.getEffectiveLevel() for lg in _LOGGERS)
    disable = logging.root.manager.disable
    return level if level > disable else disable + 1


def emit(name, levelno, pathname, lineno, msg, request_id, fields):
    logger = logging.getLogger(name)
    if logger.isEnabledFor(levelno):
        extra = {"request_id": request_id, "pd_bridge_fields": dict(fields)}
        logger.handle(logger.makeRecord(name, levelno, pathname, lineno, msg, None, None, extra=extra))
"#;

static PY_HELPERS: PyOnceLock<(Py<PyAny>, Py<PyAny>)> = PyOnceLock::new();

/// The running forwarder: the process it was started in (a fork has to start its own) and its
/// queue.
static FORWARDER: Mutex<Option<(u32, SyncSender<LogRecord>)>> = Mutex::new(None);

fn helpers(py: Python<'_>) -> Option<&(Py<PyAny>, Py<PyAny>)> {
    PY_HELPERS
        .get_or_try_init(py, || -> PyResult<_> {
            let m = PyModule::from_code(py, HELPERS, c"pd_bridge_logging.py", c"pd_bridge_logging")?;
            Ok((m.getattr("floor")?.unbind(), m.getattr("emit")?.unbind()))
        })
        .ok()
}

/// Install the layer as this module's global subscriber (once), and read Python's level.
pub(crate) fn install(py: Python<'_>) -> PyResult<()> {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    let mut first = false;
    INSTALLED.get_or_init(|| {
        first = true;
        let subscriber = tracing_subscriber::registry().with(PyLogging::new(forward));
        // Fails only if something in this module set one already; theirs then stays.
        let _ = tracing::subscriber::set_global_default(subscriber);
    });
    if first {
        let stop = PyCFunction::new_closure(py, None, None, |_args, _kwargs| STOPPED.store(true, Ordering::SeqCst))?;
        py.import("atexit")?.call_method1("register", (stop,))?;
    }
    read_level();
    Ok(())
}

/// A span whose `request_id` every core event under it carries (a binding enters it around the
/// core call that serves one request).
pub fn request_span(request_id: &str) -> tracing::Span {
    tracing::info_span!("request", request_id = %request_id)
}

/// Read the least level pd-bridge's Python loggers let through, unless it was read less than
/// [`REFRESH_MS`] ago (called at each entry point).
pub fn refresh_level() {
    let now = EPOCH.get_or_init(std::time::Instant::now).elapsed().as_millis() as u64 + 1;
    let last = LAST_REFRESH.load(Ordering::Relaxed);
    if last != 0 && now.saturating_sub(last) < REFRESH_MS {
        return;
    }
    LAST_REFRESH.store(now, Ordering::Relaxed);
    read_level();
}

fn read_level() {
    Python::attach(|py| {
        if let Some((floor, _)) = helpers(py) {
            if let Ok(level) = floor.call0(py).and_then(|v| v.extract::<i64>(py)) {
                FLOOR.store(floor_for(level), Ordering::Relaxed);
            }
        }
    });
}

/// The production sink: queue for the forwarder thread, started on first use in each process.
fn forward(record: LogRecord) {
    if STOPPED.load(Ordering::Relaxed) {
        return;
    }
    let pid = std::process::id();
    let mut slot = FORWARDER.lock().unwrap_or_else(|p| p.into_inner());
    if slot.as_ref().is_none_or(|(p, _)| *p != pid) {
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        if std::thread::Builder::new().name("pd-bridge-log".into()).spawn(move || run_forwarder(rx)).is_err() {
            DROPPED.fetch_add(1, Ordering::Relaxed);
            return;
        }
        *slot = Some((pid, tx));
    }
    let Some((_, tx)) = slot.as_ref() else { return };
    match tx.try_send(record) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
        Err(TrySendError::Disconnected(_)) => {
            DROPPED.fetch_add(1, Ordering::Relaxed);
            *slot = None; // the forwarder is gone: the next event starts another
        }
    }
}

fn run_forwarder(rx: Receiver<LogRecord>) {
    let mut batch: VecDeque<LogRecord> = VecDeque::new();
    while let Ok(first) = rx.recv() {
        batch.push_back(first);
        while batch.len() < 256 {
            match rx.try_recv() {
                Ok(r) => batch.push_back(r),
                Err(_) => break,
            }
        }
        if STOPPED.load(Ordering::SeqCst) {
            return;
        }
        // None: the interpreter is shutting down; nothing more can be logged.
        let attached = Python::try_attach(|py| {
            let Some((_, emit)) = helpers(py) else { return };
            let dropped = DROPPED.swap(0, Ordering::Relaxed);
            if dropped > 0 {
                batch.push_front(LogRecord {
                    logger: "pd_bridge.bindings".into(),
                    level: 30,
                    file: file!().into(),
                    line: line!(),
                    message: format!("pd-bridge: {dropped} Rust log events dropped (Python logging fell {QUEUE} events behind)"),
                    request_id: None,
                    fields: Vec::new(),
                });
            }
            for r in batch.drain(..) {
                let fields = PyDict::new(py);
                for (k, v) in &r.fields {
                    let _ = fields.set_item(k, v);
                }
                // A failing handler is Python's business; it must not stop the forwarder.
                if let Err(e) = emit.call1(py, (r.logger, r.level, r.file, r.line, r.message, r.request_id, fields)) {
                    e.print(py);
                }
            }
        });
        if attached.is_none() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    fn capture<R>(f: impl FnOnce() -> R) -> (R, Vec<LogRecord>) {
        let _serial = TEST_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        let seen: Arc<Mutex<Vec<LogRecord>>> = Arc::default();
        let sink = seen.clone();
        let subscriber = tracing_subscriber::registry().with(PyLogging::new(move |r| sink.lock().unwrap().push(r)));
        let out = tracing::subscriber::with_default(subscriber, f);
        let records = seen.lock().unwrap().clone();
        (out, records)
    }

    #[test]
    fn logger_names_follow_the_crate_and_module() {
        assert_eq!(logger_name("pd_bridge_core::stream"), "pd_bridge.core.stream");
        assert_eq!(logger_name("pd_bridge_core::block::writer"), "pd_bridge.core.block.writer");
        assert_eq!(logger_name("pd_bridge_core"), "pd_bridge.core");
        assert_eq!(logger_name("pd_bridge_bindings"), "pd_bridge.bindings");
        assert_eq!(logger_name("pd_bridge_omlx_native"), "pd_bridge.omlx");
        assert_eq!(logger_name("cudarc::driver"), "pd_bridge.rust.cudarc.driver");
    }

    #[test]
    fn the_request_id_comes_from_the_event_or_the_nearest_span() {
        let (_, records) = capture(|| {
            FLOOR.store(0, Ordering::Relaxed);
            tracing::warn!(target: "pd_bridge_core::stream", request_id = %"req-7", error = %"no segment for 1s", "segment stream ended early");
            let outer = tracing::info_span!("ingest", request_id = %"req-outer");
            let _o = outer.enter();
            let inner = tracing::debug_span!("block", index = 3);
            let _i = inner.enter();
            tracing::debug!(target: "pd_bridge_core::block::writer", bytes = 10u64, "block written");
            tracing::error!(request = %"req-own", "capture failed");
        });
        assert_eq!(records.len(), 3, "{records:?}");
        let r = &records[0];
        assert_eq!((r.logger.as_str(), r.level, r.request_id.as_deref()), ("pd_bridge.core.stream", 30, Some("req-7")));
        assert_eq!(r.message, "pd-bridge[req-7]: segment stream ended early (error=no segment for 1s)");
        assert!(r.file.ends_with("logging.rs") && r.line > 0);
        let r = &records[1];
        assert_eq!((r.level, r.request_id.as_deref()), (10, Some("req-outer")));
        assert_eq!(r.message, "pd-bridge[req-outer]: block written (bytes=10)");
        assert_eq!(records[2].request_id.as_deref(), Some("req-own"));
    }

    #[test]
    fn events_under_the_level_are_not_built() {
        let (_, records) = capture(|| {
            FLOOR.store(floor_for(30), Ordering::Relaxed); // WARNING
            let span = tracing::info_span!("ingest", request_id = %"r");
            let _e = span.enter();
            tracing::info!("not forwarded");
            tracing::debug!("not forwarded");
            tracing::warn!("forwarded");
        });
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].request_id.as_deref(), Some("r"), "the span was kept although INFO is off");
        let (_, records) = capture(|| {
            FLOOR.store(5, Ordering::Relaxed);
            tracing::error!("off entirely");
            FLOOR.store(3, Ordering::Relaxed);
        });
        assert!(records.is_empty());
    }

    #[test]
    fn python_levels_map_to_floors() {
        assert_eq!(floor_for(0), 0); // NOTSET: everything
        assert_eq!(floor_for(10), 1);
        assert_eq!(floor_for(20), 2);
        assert_eq!(floor_for(30), 3);
        assert_eq!(floor_for(40), 4);
        assert_eq!(floor_for(50), 5);
    }
}
