use lambda_http::{Body, Error, Request, Response, run, service_fn};

async fn hello(_request: Request) -> Result<Response<Body>, Error> {
    Ok(Response::new(Body::from("hello")))
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    run(service_fn(hello)).await
}
