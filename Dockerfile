# syntax=docker/dockerfile:1
# leasehold: multi-stage build. The final image holds one binary on distroless
# (glibc, CA certificates, no shell) and runs as a non-root user.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto proto
COPY src src
# Compiled in: the deploy templates, topology rules and settings.
COPY envoy envoy
COPY deploy deploy
# Cache mounts keep the registry and the target dir across builds, so a
# source edit does not rebuild every dependency; the binary is copied out of
# the cached target dir in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin leasehold \
 && strip target/release/leasehold \
 && cp target/release/leasehold /leasehold

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /leasehold /usr/local/bin/leasehold
COPY deploy/rules /etc/leasehold/rules
USER nonroot:nonroot
# 8081 gRPC (RateLimitService, health, reflection), 8080 HTTP (/metrics,
# /json, health). The admin pages (/status, /rules) stay on loopback unless
# LEASEHOLD_ADMIN_ADDR says otherwise (compose sets 0.0.0.0:8082).
EXPOSE 8081 8080
ENV LEASEHOLD_GRPC_ADDR=0.0.0.0:8081 \
    LEASEHOLD_HTTP_ADDR=0.0.0.0:8080 \
    LEASEHOLD_RULES=/etc/leasehold/rules
# No shell or curl in the image: the binary is its own probe (gRPC health).
HEALTHCHECK --interval=5s --timeout=2s --retries=3 \
  CMD ["/usr/local/bin/leasehold", "health", "--addr", "127.0.0.1:8081"]
ENTRYPOINT ["/usr/local/bin/leasehold"]
CMD ["serve"]
