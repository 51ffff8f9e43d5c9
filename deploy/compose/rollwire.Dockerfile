# The image of the rollwire services of deploy/compose.yaml's `fleet` profile: the package with its
# `rollwire` command, git for the sessions' workspaces, and Node.js with npm for the harness CLIs a gateway
# node installs on first use (Debian's nodejs is below their floor). Built from the checkout (context: the
# repository root, filtered by its .dockerignore): `docker compose ... build`.
FROM node:22.12.0-bookworm-slim AS node

FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*
COPY --from=node /usr/local/bin/node /usr/local/bin/node
COPY --from=node /usr/local/lib/node_modules/npm /usr/local/lib/node_modules/npm
RUN ln -s ../lib/node_modules/npm/bin/npm-cli.js /usr/local/bin/npm \
    && ln -s ../lib/node_modules/npm/bin/npx-cli.js /usr/local/bin/npx
COPY . /tmp/rollwire
RUN pip install --no-cache-dir --disable-pip-version-check --root-user-action=ignore /tmp/rollwire \
    && rm -rf /tmp/rollwire
ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["rollwire"]
