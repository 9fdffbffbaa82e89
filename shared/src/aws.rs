//! The AWS SDK configuration every function shares: one HTTPS client over rustls + ring (the
//! TLS stack sqlx and reqwest use too, so a binary links one), an optional endpoint override
//! (moto in tests, a VPC endpoint in production) and the region.

use aws_config::{BehaviorVersion, Region, SdkConfig};
use aws_smithy_http_client::tls::{Provider, rustls_provider::CryptoMode};

/// Where the AWS APIs are and in which region.
#[derive(Debug, Clone, Default)]
pub struct AwsEndpoint {
    /// Endpoint override; `None` uses AWS's public endpoints for the region.
    pub endpoint_url: Option<String>,
    /// `None` takes the region from the environment (`AWS_REGION` in Lambda).
    pub region: Option<String>,
}

/// The SDK configuration: credentials and region from the environment (Lambda sets them).
pub async fn sdk_config(endpoint: &AwsEndpoint) -> SdkConfig {
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(Provider::Rustls(CryptoMode::Ring))
        .build_https();
    let mut loader = aws_config::defaults(BehaviorVersion::latest()).http_client(http);
    if let Some(url) = &endpoint.endpoint_url {
        loader = loader.endpoint_url(url);
    }
    if let Some(region) = &endpoint.region {
        loader = loader.region(Region::new(region.clone()));
    }
    loader.load().await
}
