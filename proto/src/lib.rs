//! ZDS protocol (see issue: built in the ZDS server work).
