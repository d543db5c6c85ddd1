// refit's API in one include: the trainer side (Publisher over a ProducerGroup, with sharded
// layouts), the receiver side (ReceiverNode, with loaders for tensor-parallel and fused layouts,
// tensors in host or device memory), the transports by URI, the payload format's reader, Status,
// logging and the version. Every installed header is one of these or a type they use; the
// library's internals live beside their sources (src/<layer>/) and are not installed.
#pragma once

#include "refit/loader.h"
#include "refit/loader_layout.h"
#include "refit/logging.h"
#include "refit/payload.h"
#include "refit/producer_group.h"
#include "refit/producer_layout.h"
#include "refit/publisher.h"
#include "refit/receiver_node.h"
#include "refit/safetensors.h"
#include "refit/status.h"
#include "refit/tensor.h"
#include "refit/tensor_memory.h"
#include "refit/transport.h"
#include "refit/version.h"
#ifdef REFIT_HAVE_MPI
#include "refit/mpi.h"
#include "refit/mpi_producer_group.h"
#endif
