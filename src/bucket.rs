//! The filter's shared-data layout: bucket tables and worker slots (owned by the filter work).
