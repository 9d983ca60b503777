# ratelimitd container image.
#   docker build -t ratelimitd .
#   docker run --rm -p 8081:8081 -p 8080:8080 ratelimitd
# With no settings it serves the example rules (examples/config) from the memory store. In Kubernetes the
# rules come from a ConfigMap through the RUNTIME_* variables (deploy/kubernetes), or from Envoy Gateway over
# xDS (deploy/envoy-gateway), and REDIS_URL switches the counters to Redis.

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
# Dependencies first, so that a change to the sources alone does not rebuild them.
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto proto
RUN mkdir -p src/bin benches \
    && echo 'fn main() {}' > src/main.rs \
    && echo 'fn main() {}' > src/bin/ratelimitd-bench.rs \
    && echo 'fn main() {}' > benches/hot_path.rs \
    && touch src/lib.rs \
    && cargo build --release --locked --bin ratelimitd \
    && rm -rf src benches
COPY src src
COPY benches benches
RUN touch src/main.rs src/lib.rs \
    && cargo build --release --locked --bin ratelimitd \
    && strip target/release/ratelimitd

# glibc and libgcc only; runs as the distroless "nonroot" user (uid 65532), no shell.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/ratelimitd /usr/local/bin/ratelimitd
# The reference image's path too: Envoy Gateway starts its rate limit container with `/bin/ratelimit`.
COPY --from=build /src/target/release/ratelimitd /bin/ratelimit
COPY examples/config /srv/ratelimitd/config
WORKDIR /srv/ratelimitd
USER 65532:65532
# gRPC (rate limit service, health, reflection), then HTTP (/healthcheck, /json, /rlconfig, /metrics).
EXPOSE 8081 8080
ENTRYPOINT ["/usr/local/bin/ratelimitd"]
CMD ["serve"]
