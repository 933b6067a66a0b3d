/*
 * ficc-barrier: the trusted first executable of every payload.
 *
 * It is started by the runtime as the container's entrypoint and does nothing
 * until the host, having inspected this live process (uid/gid, capabilities,
 * NoNewPrivs, seccomp, cgroup, namespaces, rlimits, fds, mounts, and that
 * /proc/PID/exe is this very file), writes the release marker. Only then does it
 * execve() the payload argv. It never follows a link to the marker, never reads
 * more than the token's length, and exits with a distinct code on any anomaly so
 * the host can tell what went wrong.
 *
 * When the payload cannot be executed it says so in one line on stderr,
 * "ficc-barrier: cannot execute PATH: REASON (errno N)", and exits as a shell
 * does: 127 when PATH does not exist (ENOENT), 126 for anything else (EACCES,
 * ENOEXEC, ...). The host shows that line to the operator: an exit status alone
 * does not say which program was missing, nor why.
 *
 * usage: ficc-barrier MARKER TOKEN [--devices RESULT DEVICE...] -- ARGV0 [ARG...]
 *   MARKER  absolute path of the release marker (inside a directory the host owns)
 *   TOKEN   the exact bytes the marker must contain
 *   RESULT  absolute path of a new file for the device-open results (optional)
 *   DEVICE  absolute path of a device node to try to open (read-write) first
 *   ARGV0   absolute path of the payload program
 *
 * With --devices, before waiting, the barrier opens each DEVICE exactly as a payload
 * would, closes it again, and writes one line "ERRNO PATH" per device (0 = opened)
 * to RESULT (written under a temporary name and renamed, so it appears complete).
 * These are the runner's real device-open results: the host compares them with the
 * devices the policy must allow and refuse before it releases the payload.
 *
 * While waiting it holds no descriptor besides 0, 1 and 2 (the payload gate refuses
 * any other), so it polls for the marker instead of keeping an inotify descriptor.
 *
 * Built static (no dynamic loader) so no library or loader path can be swapped
 * under it between the host's check and the exec.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <string.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

enum {
    EXIT_PROBE_FAILED = 119,  /* the device-open results could not be written */
    EXIT_USAGE = 120,         /* bad arguments: the provider built a wrong argv */
    EXIT_MARKER_UNSAFE = 121, /* marker is a link, not a regular file, or too big */
    EXIT_MARKER_TOKEN = 122,  /* marker exists but holds another token */
    EXIT_WAIT_FAILED = 123,   /* the wait itself failed (poll error) */
    EXIT_EXEC_DENIED = 126,   /* the payload cannot be executed (EACCES, ENOEXEC, ...) */
    EXIT_EXEC_MISSING = 127,  /* the payload's program does not exist (ENOENT) */
};

#define TOKEN_MAX 128
#define DEVICES_MAX 64
#define POLL_MS 2

static void say(const char *msg) {
    ssize_t ignored = write(STDERR_FILENO, msg, strlen(msg));
    (void)ignored;
}

/* 0: not there yet; 1: released; otherwise an exit code. */
static int check_marker(const char *marker, const char *token) {
    int fd = open(marker, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        if (errno == ENOENT) return 0;
        say("ficc-barrier: marker cannot be opened safely (link or unreadable)\n");
        return EXIT_MARKER_UNSAFE;
    }
    struct stat st;
    size_t want = strlen(token);
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > (off_t)want) {
        close(fd);
        say("ficc-barrier: marker is not a regular file of the expected size\n");
        return EXIT_MARKER_UNSAFE;
    }
    if (st.st_size < (off_t)want) {
        /* Still being written (the host may write in place): keep waiting. */
        close(fd);
        return 0;
    }
    char buf[TOKEN_MAX];
    ssize_t got = read(fd, buf, want);
    close(fd);
    if (got != (ssize_t)want || memcmp(buf, token, want) != 0) {
        say("ficc-barrier: marker holds another token\n");
        return EXIT_MARKER_TOKEN;
    }
    return 1;
}

static int wait_for_marker(const char *marker, const char *token) {
    for (;;) {
        int state = check_marker(marker, token);
        if (state != 0) return state == 1 ? 0 : state;
        /* poll() with no descriptors is the sleep: the host waits for this syscall. */
        if (poll(NULL, 0, POLL_MS) < 0 && errno != EINTR) {
            say("ficc-barrier: wait failed\n");
            return EXIT_WAIT_FAILED;
        }
    }
}

static int write_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Open each device as the payload would; record errno (0 = opened a char device). */
static int probe_devices(const char *result, char **devices, int count) {
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", result) >= (int)sizeof tmp) return EXIT_USAGE;
    int out = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (out < 0) {
        say("ficc-barrier: cannot create the device result file\n");
        return EXIT_PROBE_FAILED;
    }
    for (int i = 0; i < count; i++) {
        int code = 0;
        int fd = open(devices[i], O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
        if (fd < 0) {
            code = errno;
        } else {
            struct stat st;
            if (fstat(fd, &st) != 0 || !S_ISCHR(st.st_mode)) code = ENODEV;
            close(fd);
        }
        char line[PATH_MAX + 32];
        int len = snprintf(line, sizeof line, "%d %s\n", code, devices[i]);
        if (len < 0 || len >= (int)sizeof line || write_all(out, line, (size_t)len) != 0) {
            close(out);
            say("ficc-barrier: cannot write the device result file\n");
            return EXIT_PROBE_FAILED;
        }
    }
    if (close(out) != 0 || rename(tmp, result) != 0) {
        say("ficc-barrier: cannot publish the device result file\n");
        return EXIT_PROBE_FAILED;
    }
    return 0;
}

/* One line naming the program and the reason, in one write (nothing else writes to
 * stderr now), then the shell's exit status for it. strerrordesc_np is the C
 * locale's text without gettext, which keeps the static binary small. */
static int exec_failed(const char *program, int code) {
    static const char prefix[] = "ficc-barrier: cannot execute ";
    const char *reason = strerrordesc_np(code);
    if (reason == NULL) reason = "unknown error";
    char number[32];
    int len = snprintf(number, sizeof number, " (errno %d)\n", code);
    struct iovec parts[] = {
        {(char *)prefix, sizeof prefix - 1},
        {(char *)program, strlen(program)},
        {(char *)": ", 2},
        {(char *)reason, strlen(reason)},
        {number, len > 0 ? (size_t)len : 0},
    };
    ssize_t ignored = writev(STDERR_FILENO, parts, sizeof parts / sizeof parts[0]);
    (void)ignored;
    return code == ENOENT ? EXIT_EXEC_MISSING : EXIT_EXEC_DENIED;
}

static int usage(void) {
    say("usage: ficc-barrier MARKER TOKEN [--devices RESULT DEVICE...] -- "
        "/ABSOLUTE/PROGRAM [ARG...]\n");
    return EXIT_USAGE;
}

int main(int argc, char **argv) {
    if (argc < 5 || argv[1][0] != '/' || strlen(argv[2]) == 0 || strlen(argv[2]) > TOKEN_MAX)
        return usage();
    int next = 3;
    const char *result = NULL;
    char **devices = NULL;
    int count = 0;
    if (strcmp(argv[next], "--devices") == 0) {
        if (next + 1 >= argc || argv[next + 1][0] != '/') return usage();
        result = argv[next + 1];
        devices = &argv[next + 2];
        for (next += 2; next < argc && strcmp(argv[next], "--") != 0; next++) {
            if (argv[next][0] != '/' || ++count > DEVICES_MAX) return usage();
        }
    }
    if (next + 1 >= argc || strcmp(argv[next], "--") != 0 || argv[next + 1][0] != '/')
        return usage();
    if (result != NULL) {
        int rc = probe_devices(result, devices, count);
        if (rc != 0) return rc;
    }
    int rc = wait_for_marker(argv[1], argv[2]);
    if (rc != 0) return rc;
    extern char **environ;
    execve(argv[next + 1], &argv[next + 1], environ);
    return exec_failed(argv[next + 1], errno);
}
