//! The ceiling of any gRPC server on this machine: a minimal tonic server
//! whose ShouldRateLimit answers a constant OK without looking at the
//! request. `leasehold bench` against it measures transport cost alone.
//!
//! cargo run --release --example constant_ok -- 127.0.0.1:18090

use leasehold::proto::rls::rate_limit_response::{Code, DescriptorStatus};
use leasehold::proto::rls::rate_limit_service_server::{RateLimitService, RateLimitServiceServer};
use leasehold::proto::rls::{RateLimitRequest, RateLimitResponse};
use tonic::{Request, Response, Status};

struct ConstantOk;

#[tonic::async_trait]
impl RateLimitService for ConstantOk {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let n = request.get_ref().descriptors.len();
        Ok(Response::new(RateLimitResponse {
            overall_code: Code::Ok as i32,
            statuses: vec![
                DescriptorStatus {
                    code: Code::Ok as i32,
                    ..Default::default()
                };
                n
            ],
            ..Default::default()
        }))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:18090".into())
        .parse()?;
    tonic::transport::Server::builder()
        .add_service(RateLimitServiceServer::new(ConstantOk))
        .serve(addr)
        .await?;
    Ok(())
}
