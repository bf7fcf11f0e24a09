# The Shepherd Model Gateway (PyPI `smg`, a Rust binary in a wheel) for a prefill/decode
# deployment (deploy/kubernetes/pd, docs/operations/disaggregation.md):
#
#   docker build -f docker/smg.Dockerfile -t deepinfer-smg:latest .
#
# Its own image, as its `smg` script clashes with sglang-router's; no GPU or CUDA needed.
ARG PYTHON_VERSION=3.12
FROM python:${PYTHON_VERSION}-slim-bookworm
ARG SMG_VERSION=1.13.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install "smg==${SMG_VERSION}" \
    && useradd --system --no-create-home --uid 10001 smg
USER 10001
EXPOSE 8000 29000
ENTRYPOINT ["smg"]
CMD ["launch", "--help"]
