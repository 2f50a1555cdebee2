#!/usr/bin/env bash
# Deploy the rdq stack into LocalStack (started by docker-compose.yml here), with the bundled
# packaging: LocalStack Community does not apply Lambda layers. Usage:
#   infra/localstack/deploy.sh [postgres|redis|mongo]
# Needs: samlocal and awslocal (pip install aws-sam-cli-local awscli-local), the rdq CLI with the
# backend's driver (pip install -e '.[postgres]', '.[redis]' or '.[mongo]' from this repository),
# and a running `docker compose -f infra/localstack/docker-compose.yml up -d`.
set -euo pipefail
cd "$(dirname "$0")/../.."

need() {  # need COMMAND HOW-TO-GET-IT
  command -v "$1" >/dev/null 2>&1 || { echo "deploy.sh needs '$1' on PATH: $2" >&2; exit 2; }
}
need samlocal "pip install aws-sam-cli-local (it wraps the AWS SAM CLI)"
need awslocal "pip install awscli-local"
need rdq "pip install -e '.[postgres]' (or .[redis], .[mongo]) from this repository"
need make "the functions are built by functions/Makefile"

backend="${1:-postgres}"
# The Lambda containers run on the compose network (LAMBDA_DOCKER_NETWORK), so they reach the
# stores by service name; this machine reaches them on the ports published on 127.0.0.1.
case "$backend" in
  postgres) url="postgresql://postgres:rdq@postgres:5432/rdq"; local_url="postgresql://postgres:rdq@127.0.0.1:5432/rdq"; storage_backend=postgresql ;;
  redis)    url="redis://redis:6379/0"; local_url="redis://127.0.0.1:6379/0"; storage_backend=redis ;;
  mongo)    url="mongodb://mongo:27017/rdq"; local_url="mongodb://127.0.0.1:27017/rdq"; storage_backend=mongodb ;;
  *) echo "unknown backend: $backend (postgres, redis or mongo)" >&2; exit 2 ;;
esac

export AWS_DEFAULT_REGION="${AWS_DEFAULT_REGION:-us-east-1}" AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test
endpoint="${LOCALSTACK_ENDPOINT:-http://127.0.0.1:4566}"
stack=rdq-local

curl -fsS "$endpoint/_localstack/health" >/dev/null 2>&1 \
  || { echo "no LocalStack at $endpoint: docker compose -f infra/localstack/docker-compose.yml up -d" >&2; exit 2; }

# Create the schema from this machine (the functions do not migrate by default).
rdq --storage "$local_url" migrate

awslocal ssm put-parameter --name /rdq/storage-url --type SecureString --value "$url" --overwrite >/dev/null

# Each function's package carries rdq_core, Powertools and this backend's driver (Packaging=bundled).
RDQ_BUNDLE="$storage_backend" samlocal build
samlocal deploy --stack-name "$stack" --resolve-s3 --capabilities CAPABILITY_IAM --no-confirm-changeset \
  --parameter-overrides Packaging=bundled StorageBackend="$storage_backend" StorageUrlParameterName=/rdq/storage-url \
    AuthMode=API_KEY MaxWorkerConcurrency=2

output() {  # output KEY: one output of this stack
  awslocal cloudformation describe-stacks --stack-name "$stack" \
    --query "Stacks[0].Outputs[?OutputKey=='$1'].OutputValue" --output text
}
api_id=$(output ApiId)
key_id=$(output ApiKeyId)
# The ApiUrl output needs public DNS; LocalStack also serves every stage at this path-style URL.
echo "API: $endpoint/restapis/${api_id}/prod/_user_request_/v1/openapi.json"
echo "API key: $(awslocal apigateway get-api-key --api-key "$key_id" --include-value --query value --output text)"
