// The real authorization server of the end-to-end tests: oidc-provider (a certified
// OpenID Provider), configured by tests/src/oidc.rs and started on a loopback port.
//
//   node server.mjs CONFIG.json
//
// CONFIG holds: `cert`, `key` (PEM files of the HTTPS listener), `port` (0: any), `keys`
// (a JWK file of the signing key: read if it exists, else made and written, so a restart
// signs with the same key), `resource` (the daemon's public URL; or `resources`, a list
// of public URLs — one per daemon of a fleet — each its own audience), `scopes` (the
// resource's scopes), `ttl` (access-token lifetime, seconds), `clients` (client_id,
// client_secret, `format`: "jwt" or "opaque"), `introspector` (client_id,
// client_secret: the daemon's own client), `introspection_delay` (a file holding the
// milliseconds every introspection answer waits before it is computed, read per request:
// a test makes the issuer slow, or stalled, while it runs).
//
// It listens on `listen` (an address; 127.0.0.1 when absent) only, prints one line
// `{"issuer": …, "port": …}` once it serves, and exits when its standard input closes (the test that started it is gone).

import crypto from 'node:crypto';
import fs from 'node:fs';
import https from 'node:https';

import Provider, { errors } from 'oidc-provider';

const config = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));

function signingKey() {
  if (fs.existsSync(config.keys)) {
    return JSON.parse(fs.readFileSync(config.keys, 'utf8'));
  }
  const { privateKey } = crypto.generateKeyPairSync('ec', { namedCurve: 'P-256' });
  const jwk = { ...privateKey.export({ format: 'jwk' }), kid: 'es256-1', alg: 'ES256', use: 'sig' };
  fs.writeFileSync(config.keys, JSON.stringify(jwk), { mode: 0o600 });
  return jwk;
}

const resources = config.resources ?? [config.resource];
const listen = config.listen ?? '127.0.0.1';
const formats = new Map(config.clients.map((c) => [c.client_id, c.format]));

const server = https.createServer({
  cert: fs.readFileSync(config.cert),
  key: fs.readFileSync(config.key),
});

server.listen(config.port, listen, () => {
  const { port } = server.address();
  const issuer = `https://${listen}:${port}`;
  const provider = new Provider(issuer, {
    clients: [
      ...config.clients.map((c) => ({
        client_id: c.client_id,
        client_secret: c.client_secret,
        grant_types: ['client_credentials'],
        redirect_uris: [],
        response_types: [],
        token_endpoint_auth_method: 'client_secret_basic',
        id_token_signed_response_alg: 'ES256',
        scope: config.scopes.join(' '),
      })),
      {
        client_id: config.introspector.client_id,
        client_secret: config.introspector.client_secret,
        grant_types: [],
        redirect_uris: [],
        response_types: [],
        token_endpoint_auth_method: 'client_secret_basic',
        id_token_signed_response_alg: 'ES256',
      },
    ],
    jwks: { keys: [signingKey()] },
    cookies: { keys: [crypto.randomBytes(32).toString('hex')] },
    scopes: config.scopes,
    features: {
      devInteractions: { enabled: false },
      clientCredentials: { enabled: true },
      introspection: { enabled: true },
      revocation: { enabled: true },
      resourceIndicators: {
        enabled: true,
        defaultResource: () => resources[0],
        useGrantedResource: () => true,
        // RFC 8707: tokens for one daemon's public URL, its audience alone; JWT (RFC 9068) access tokens for
        // some clients, opaque ones (checked by introspection) for others.
        getResourceServerInfo: (_ctx, resource, client) => {
          if (!resources.includes(resource)) {
            throw new errors.InvalidTarget();
          }
          return {
            scope: config.scopes.join(' '),
            audience: resource,
            accessTokenTTL: config.ttl,
            accessTokenFormat: formats.get(client.clientId) === 'jwt' ? 'jwt' : 'opaque',
            jwt: { sign: { alg: 'ES256' } },
          };
        },
      },
    },
    // A client-credentials token speaks for its client: its subject is the client id, in
    // the introspection answer as in the JWT (where oidc-provider does this itself).
    extraTokenClaims: (_ctx, token) => (token.accountId ? undefined : { sub: token.clientId }),
  });
  // A slow issuer, as the test says at this moment.
  provider.use(async (ctx, next) => {
    if (ctx.method === 'POST' && ctx.path.endsWith('/token/introspection')) {
      let ms = 0;
      try {
        ms = Number.parseInt(fs.readFileSync(config.introspection_delay, 'utf8'), 10) || 0;
      } catch {
        ms = 0;
      }
      if (ms > 0) {
        await new Promise((resolve) => setTimeout(resolve, ms));
      }
    }
    await next();
  });
  server.on('request', provider.callback());
  process.stdout.write(`${JSON.stringify({ issuer, port })}\n`);
});

process.stdin.on('end', () => process.exit(0));
process.stdin.on('error', () => process.exit(0));
process.stdin.resume();
