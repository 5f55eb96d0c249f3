//! Logs and traces. Logs go to stderr as text or JSON under a level filter;
//! when `otlp_endpoint` is set, spans are also exported over OTLP/gRPC, and
//! the W3C trace context (`traceparent`, `tracestate`) of an incoming gRPC
//! call becomes the parent of its span, so Envoy's traces continue into
//! leasehold.

use std::time::Duration;

use opentelemetry::propagation::Extractor;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use tracing_subscriber::filter::{filter_fn, EnvFilter};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::Layer as _;

/// What must be flushed at exit.
#[derive(Default)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Flushes and stops the span exporter (bounded: it has its own timeout).
    pub async fn shutdown(self) {
        if let Some(provider) = self.provider {
            let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
        }
    }
}

/// Installs the global subscriber. Must run inside the tokio runtime: the
/// OTLP exporter's gRPC channel lives on it.
pub fn init(
    level: &str,
    format: &str,
    otlp_endpoint: Option<&str>,
    service_name: &str,
) -> anyhow::Result<Telemetry> {
    let filter = EnvFilter::try_new(level).unwrap_or_else(|_| EnvFilter::new("info"));
    // Colours only on a terminal: log files and collectors get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    let fmt = if format == "json" {
        fmt.json().boxed()
    } else {
        fmt.boxed()
    };
    let provider = match otlp_endpoint {
        Some(endpoint) => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .with_timeout(Duration::from_secs(3))
                .build()?;
            let batch = BatchConfigBuilder::default()
                .with_scheduled_delay(Duration::from_millis(500))
                .build();
            let provider = SdkTracerProvider::builder()
                .with_span_processor(
                    BatchSpanProcessor::builder(exporter)
                        .with_batch_config(batch)
                        .build(),
                )
                .with_resource(
                    Resource::builder()
                        .with_service_name(service_name.to_string())
                        .build(),
                )
                .build();
            opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
            Some(provider)
        }
        None => None,
    };
    // Exported: leasehold's spans (the per-call span is at debug level, so
    // logs at the default level never pay for it) and its events at info and
    // above, whatever the log level, so quieter logs do not lose traces.
    let otel = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("leasehold"))
            .with_filter(filter_fn(|meta| {
                meta.target().starts_with("leasehold")
                    && if meta.is_span() {
                        *meta.level() <= tracing::Level::DEBUG
                    } else {
                        *meta.level() <= tracing::Level::INFO
                    }
            }))
    });
    tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(otel)
        .try_init()?;
    if let Some(endpoint) = otlp_endpoint {
        tracing::info!(endpoint, "exporting traces over OTLP/gRPC");
    }
    Ok(Telemetry { provider })
}

/// Reads W3C trace context from gRPC metadata.
pub struct MetadataExtractor<'a>(pub &'a tonic::metadata::MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// The parent context carried by an incoming call (empty when it has none
/// or no exporter is configured).
pub fn parent_context(metadata: &tonic::metadata::MetadataMap) -> opentelemetry::Context {
    opentelemetry::global::get_text_map_propagator(|p| p.extract(&MetadataExtractor(metadata)))
}
