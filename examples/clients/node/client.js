// Asking ratelimitd (or any Envoy rate limit service) from Node.js: a client a service can copy.
//
//   npm ci
//   node client.js --domain edge remote_address=203.0.113.7 path=/login method=POST
//
// The protos are read at start from the repository's proto/ folder (PROTO_DIR to point elsewhere).
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_DIR = process.env.PROTO_DIR || path.join(__dirname, "..", "..", "..", "proto");

const definition = protoLoader.loadSync("envoy/service/ratelimit/v3/rls.proto", {
  includeDirs: [PROTO_DIR],
  keepCase: true,
  longs: Number,
  enums: String,
  defaults: true,
});
const rls = grpc.loadPackageDefinition(definition).envoy.service.ratelimit.v3;

/**
 * One client per process; one call per request to protect. `failOpen`: what to do when the service cannot
 * answer within `timeoutMs` (true lets the request through, so that a limiter outage is not an outage).
 */
class RateLimiter {
  constructor(address, domain, { timeoutMs = 50, failOpen = true } = {}) {
    this.client = new rls.RateLimitService(address, grpc.credentials.createInsecure());
    this.domain = domain;
    this.timeoutMs = timeoutMs;
    this.failOpen = failOpen;
  }

  /** Each descriptor is an array of [key, value] pairs. Resolves to { allowed, response }. */
  check(descriptors, hits = 1) {
    const request = {
      domain: this.domain,
      hits_addend: hits,
      descriptors: descriptors.map((entries) => ({
        entries: entries.map(([key, value]) => ({ key, value })),
      })),
    };
    const deadline = new Date(Date.now() + this.timeoutMs);
    return new Promise((resolve) => {
      this.client.ShouldRateLimit(request, { deadline }, (err, response) => {
        if (err) {
          console.error(`rate limit check failed (${grpc.status[err.code]}): ${err.details}`);
          resolve({ allowed: this.failOpen, response: null });
          return;
        }
        resolve({ allowed: response.overall_code !== "OVER_LIMIT", response });
      });
    });
  }

  close() {
    this.client.close();
  }
}

async function main(argv) {
  let address = "127.0.0.1:8081";
  let domain = "edge";
  let hits = 1;
  const entries = [];
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === "--address") address = argv[++i];
    else if (argv[i] === "--domain") domain = argv[++i];
    else if (argv[i] === "--hits") hits = Number(argv[++i]);
    else {
      const at = argv[i].indexOf("=");
      if (at < 0) throw new Error(`expected key=value, got ${argv[i]}`);
      entries.push([argv[i].slice(0, at), argv[i].slice(at + 1)]);
    }
  }
  const limiter = new RateLimiter(address, domain, { timeoutMs: 500 });
  const { allowed, response } = await limiter.check([entries], hits);
  limiter.close();
  if (!response) {
    console.log(allowed ? "UNAVAILABLE (allowed: fail open)" : "UNAVAILABLE (denied)");
    return allowed ? 0 : 1;
  }
  console.log(response.overall_code);
  for (const status of response.statuses) {
    const limit = status.current_limit;
    if (!limit) {
      console.log("  no limit applies");
      continue;
    }
    const reset = status.duration_until_reset ? status.duration_until_reset.seconds : 0;
    console.log(
      `  ${status.code}: ${limit.requests_per_unit} per ${limit.unit.toLowerCase()}, ` +
        `${status.limit_remaining} left, reset in ${reset}s`,
    );
  }
  return allowed ? 0 : 1;
}

module.exports = { RateLimiter };

if (require.main === module) {
  main(process.argv.slice(2)).then(
    (code) => process.exit(code),
    (err) => {
      console.error(err.message);
      process.exit(2);
    },
  );
}
