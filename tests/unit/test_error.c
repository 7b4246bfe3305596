/* kvs_error: names and texts of every project code, and the text of errno,
 * ZeroMQ and LMDB codes. */
#include <errno.h>
#include <lmdb.h>
#include <string.h>
#include <zmq.h>

#include "check_main.h"
#include "kvs_error.h"

START_TEST(names_round_trip)
{
	for (int c = KVS_E_BASE; c <= KVS_E_LAST_; c++) {
		const char *n = kvs_error_name(c);
		ck_assert_int_eq(strncmp(n, "E_", 2), 0);
		ck_assert_int_eq(kvs_error_from_name(n, strlen(n)), c);
		ck_assert_str_ne(kvs_strerror(c), "unknown error");
	}
	ck_assert_str_eq(kvs_error_name(KVS_E_LAZY_RECURRENT), "E_LAZY_RECURRENT");
	ck_assert_int_eq(kvs_error_from_name("E_NOPE", 6), KVS_E_INTERNAL);
	ck_assert_str_eq(kvs_error_name(-ENOMEM), "E_INTERNAL");
}
END_TEST

START_TEST(foreign_codes)
{
	ck_assert_str_eq(kvs_strerror(0), "success");
	ck_assert_str_eq(kvs_strerror(-ENOENT), strerror(ENOENT));
	ck_assert_str_eq(kvs_strerror(MDB_NOTFOUND), mdb_strerror(MDB_NOTFOUND));
	ck_assert_str_eq(kvs_strerror(MDB_MAP_FULL), mdb_strerror(MDB_MAP_FULL));
	ck_assert_str_eq(kvs_strerror(-EFSM), zmq_strerror(EFSM));
	ck_assert_str_eq(kvs_strerror(12345), "unknown error");
}
END_TEST

static Suite *error_suite(void)
{
	Suite *s = suite_create("error");
	TCase *tc = tcase_create("error");
	tcase_add_test(tc, names_round_trip);
	tcase_add_test(tc, foreign_codes);
	suite_add_tcase(s, tc);
	return s;
}

KVS_CHECK_MAIN(error_suite)
