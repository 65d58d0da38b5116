# syntax=docker/dockerfile:1
# One image for every luftpause service: the `luftpause` console script is the entrypoint and the
# subcommand picks the service (`scheduler`, `dataplane`, `runtime`, `fake-engine`, `fake-mcp`).
# compose.yaml runs each of them from it; `docker run IMAGE --help` lists the rest.
#
# The first stage builds a virtual environment with luftpause and its dependencies; the second
# copies only that onto a clean base, so no compiler or build cache ships. Both stages use the
# same pinned base, so the venv's interpreter path exists in the final image.

FROM python:3.12.8-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/luftpause
COPY pyproject.toml README.md LICENSE ./
COPY luftpause/ luftpause/
COPY proto/ proto/
COPY scheduler/ scheduler/
COPY dataplane/ dataplane/
COPY runtime/ runtime/
COPY fake_engine/ fake_engine/
COPY fake_mcp/ fake_mcp/
COPY loadgen/ loadgen/
COPY bench/ bench/
RUN /opt/luftpause/bin/pip install --no-cache-dir '.[postgresql]' && /opt/luftpause/bin/luftpause --version

FROM python:3.12.8-slim-bookworm
ARG LUFTPAUSE_VERSION=dev
# The last label proves to the MCP Registry that this image belongs to server.json's entry.
LABEL org.opencontainers.image.title="luftpause" \
      org.opencontainers.image.description="Run-aware scheduling between agent harnesses and LLM inference engines" \
      org.opencontainers.image.version="${LUFTPAUSE_VERSION}" \
      org.opencontainers.image.licenses="BUSL-1.1" \
      io.modelcontextprotocol.server.name="io.github.vmedvedovskiy/luftpause"
# A fixed uid (USER below names it by number), so that a bind-mounted state directory can be
# given to it on the host.
RUN groupadd --system --gid 10001 luftpause \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/luftpause --create-home luftpause
COPY --from=build /opt/luftpause /opt/luftpause
ENV PATH=/opt/luftpause/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
# The runtime's journal (runs.jsonl, tasks.jsonl): compose mounts a named volume here, which takes
# this directory's owner on first use.
WORKDIR /var/lib/luftpause
# scheduler gRPC and status, runtime, dataplane, fake engines, fake MCP
EXPOSE 5000 5001 7000 8080 9001 9002 9100
HEALTHCHECK --interval=5s --timeout=5s --start-period=30s --retries=6 \
  CMD ["python", "-m", "luftpause.healthcheck"]
ENTRYPOINT ["luftpause"]
CMD ["--help"]
