//! The local runner's partner listener: `POST /partners/{source_id}` over TLS with client
//! certificate authentication (rustls), as the stack's partner domain serves it with API
//! Gateway's mutual TLS. A client certificate is asked for and, when one is sent, verified
//! against the partners' CA (`--partner-client-ca`), as API Gateway verifies it against its
//! truststore; a connection without one is let through, so that ingest refuses it
//! (`no_client_certificate`) and the refusal is kept, as in AWS a request that skipped the
//! partner domain would be. Each request reaches the same ingest handler with the request
//! context API Gateway builds: the TCP peer as `http.sourceIp`, the certificate as
//! `authentication.clientCert` (its PEM and `validity.notAfter`).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::connect_info::Connected;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Path as RoutePath, State};
use axum::http::{HeaderMap, Uri};
use axum::response::Response;
use axum::routing::post;
use axum::serve::{IncomingStream, Listener};
use lambda_http::aws_lambda_events::apigw::{
    ApiGatewayV2httpRequestContext, ApiGatewayV2httpRequestContextAuthentication,
    ApiGatewayV2httpRequestContextAuthenticationClientCert,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::serve::Runner;

/// Where the partner listener's TLS comes from: its own certificate and key, and the CA that
/// issues partners' client certificates.
#[derive(Debug, Clone)]
pub struct PartnerTlsFiles<'a> {
    pub certificate: &'a Path,
    pub key: &'a Path,
    pub client_ca: &'a Path,
}

/// The TLS acceptor for [`PartnerTlsFiles`]: TLS 1.2 and 1.3, a client certificate optional but
/// verified against the CA when sent.
pub fn acceptor(files: &PartnerTlsFiles<'_>) -> Result<TlsAcceptor, String> {
    let read = |what: &str, path: &Path| {
        std::fs::read(path).map_err(|e| format!("{what} {}: {e}", path.display()))
    };
    let chain: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(&read("partner TLS certificate", files.certificate)?)
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{}: {e}", files.certificate.display()))?;
    let key = PrivateKeyDer::from_pem_slice(&read("partner TLS key", files.key)?)
        .map_err(|e| format!("{}: {e}", files.key.display()))?;
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(&read("partner client CA", files.client_ca)?) {
        let ca = ca.map_err(|e| format!("{}: {e}", files.client_ca.display()))?;
        roots
            .add(ca)
            .map_err(|e| format!("{}: {e}", files.client_ca.display()))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .allow_unauthenticated()
    .build()
    .map_err(|e| format!("{}: {e}", files.client_ca.display()))?;
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| format!("{}: {e}", files.certificate.display()))?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// A TCP listener whose connections are TLS: a handshake that fails (no TLS, a certificate not
/// from the CA) or takes over 10 s is logged and dropped.
pub struct PartnerListener {
    tcp: TcpListener,
    acceptor: TlsAcceptor,
}

impl PartnerListener {
    pub fn new(tcp: TcpListener, acceptor: TlsAcceptor) -> Self {
        PartnerListener { tcp, acceptor }
    }
}

impl Listener for PartnerListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (tcp, peer) = match self.tcp.accept().await {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "partner listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            match tokio::time::timeout(Duration::from_secs(10), self.acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => return (tls, peer),
                Ok(Err(error)) => {
                    tracing::warn!(%peer, %error, "partner listener: TLS handshake refused")
                }
                Err(_) => tracing::warn!(%peer, "partner listener: TLS handshake timed out"),
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

/// What a partner's connection says of its sender: the TCP peer and the client certificate
/// (DER) it presented, if any.
#[derive(Debug, Clone)]
pub struct PartnerPeer {
    pub address: SocketAddr,
    pub certificate: Option<Vec<u8>>,
}

impl Connected<IncomingStream<'_, PartnerListener>> for PartnerPeer {
    fn connect_info(stream: IncomingStream<'_, PartnerListener>) -> Self {
        let (_, connection) = stream.io().get_ref();
        PartnerPeer {
            address: *stream.remote_addr(),
            certificate: connection
                .peer_certificates()
                .and_then(|chain| chain.first())
                .map(|c| c.to_vec()),
        }
    }
}

/// `POST /partners/{source_id}`.
pub fn router(runner: Runner, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/partners/{source_id}", post(receive))
        .layer(DefaultBodyLimit::max(max_body_bytes.saturating_add(1)))
        .with_state(runner)
}

/// Serves the partner route on `listener` until it fails or the task is dropped.
pub async fn serve(listener: PartnerListener, router: Router) -> std::io::Result<()> {
    axum::serve(
        listener,
        router.into_make_service_with_connect_info::<PartnerPeer>(),
    )
    .await
}

/// API Gateway's `clientCert` for a certificate: its PEM, subject and validity as OpenSSL
/// writes them.
fn client_cert(der: &[u8]) -> ApiGatewayV2httpRequestContextAuthenticationClientCert {
    use base64::Engine as _;
    let encoded = base64::engine::general_purpose::STANDARD.encode(der);
    let mut pem = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in encoded.as_bytes().chunks(64) {
        pem.push_str(&String::from_utf8_lossy(line));
        pem.push('\n');
    }
    pem.push_str("-----END CERTIFICATE-----\n");
    let mut cert = ApiGatewayV2httpRequestContextAuthenticationClientCert::default();
    cert.client_cert_pem = Some(pem);
    if let Ok((_, parsed)) = x509_parser::parse_x509_certificate(der) {
        cert.subject_dn = Some(parsed.subject().to_string());
        cert.issuer_dn = Some(parsed.issuer().to_string());
        cert.serial_number = Some(parsed.raw_serial_as_string());
        let openssl = |t: x509_parser::time::ASN1Time| {
            chrono::DateTime::from_timestamp(t.timestamp(), 0)
                .map(|at| at.format("%b %e %H:%M:%S %Y GMT").to_string())
        };
        cert.validity.not_before = openssl(parsed.validity().not_before);
        cert.validity.not_after = openssl(parsed.validity().not_after);
    }
    cert
}

async fn receive(
    State(runner): State<Runner>,
    ConnectInfo(peer): ConnectInfo<PartnerPeer>,
    RoutePath(source_id): RoutePath<String>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut context = ApiGatewayV2httpRequestContext::default();
    context.http.source_ip = Some(peer.address.ip().to_string());
    context.authentication = peer.certificate.as_deref().map(|der| {
        let mut authentication = ApiGatewayV2httpRequestContextAuthentication::default();
        authentication.client_cert = Some(client_cert(der));
        authentication
    });
    crate::serve::to_ingest(&runner, source_id, uri, headers, body, context).await
}
