// Filled in by the producer-group work.
#include "refit/producer_group.h"
